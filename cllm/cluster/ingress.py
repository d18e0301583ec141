"""CllmIngress: the FastAPI app of cllm.server as the Ray Serve ingress, over engine replicas.

The app is built per ingress replica (``__serve_build_asgi_app__``, Serve's
late-bound ingress), after the constructor has asked a replica for the model's
facts, so routes, streaming, errors, auth and metrics are the single-process
server's own code.
"""
from __future__ import annotations

import asyncio
from typing import Any

from cllm.cluster.remote_engine import RemoteEngine, load_tokenizer
from cllm.cluster.stats_board import stats_board
from cllm.cluster.transport import HolderClient
from cllm.config import CllmConfig
from cllm.router import declared_models
from cllm.server.app import create_app


class CllmIngress:
    """Deployment class; wrapped with ``serve.ingress()`` by cllm.cluster.app."""

    async def __init__(self, config: dict[str, Any], engines: Any, decoders: Any | None = None,
                       models: dict[str, Any] | None = None) -> None:
        self.config = CllmConfig.model_validate(config)
        self.engine: RemoteEngine | None = None
        self.engines: dict[str, RemoteEngine] | None = None
        if models:  # several declared models: one replica set (deployment) each
            specs = {spec.name: spec for spec in declared_models(self.config)}
            self.engines = {name: await self._remote(specs[name].config, handle, None, name)
                            for name, handle in models.items()}
        else:
            self.engine = await self._remote(self.config, engines, decoders, "")

    @staticmethod
    async def _remote(config: CllmConfig, engines: Any, decoders: Any | None, model: str) -> RemoteEngine:
        info = await engines.info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, config)
        return RemoteEngine(config, info, engines, decoders, stats_board(), tokenizer,
                            HolderClient(ttl_s=config.cluster.handoff_ttl_s), model=model)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.config, engine=self.engine, engines=self.engines)
