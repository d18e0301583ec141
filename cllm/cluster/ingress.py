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
from cllm.server.app import create_app


class CllmIngress:
    """Deployment class; wrapped with ``serve.ingress()`` by cllm.cluster.app."""

    async def __init__(self, config: dict[str, Any], engines: Any, decoders: Any | None = None) -> None:
        self.config = CllmConfig.model_validate(config)
        info = await engines.info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, self.config)
        self.engine = RemoteEngine(self.config, info, engines, decoders, stats_board(), tokenizer,
                                   HolderClient(ttl_s=self.config.cluster.handoff_ttl_s))

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.config, engine=self.engine)
