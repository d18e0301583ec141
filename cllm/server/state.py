"""Everything one server app holds: config, engine, phase, metrics. Lives on ``app.state.cllm``."""
from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from cllm.config import CllmConfig
from cllm.server.client_quota import AdmissionPolicy, ClientQuota
from cllm.server.errors import APIError
from cllm.server.metrics import ServerMetrics
from cllm.server.sampling import RequestLimits


class Phase(str, enum.Enum):
    """Where the server is in its life; only READY serves generation."""

    LOADING = "loading"  # model loading in a thread; /health answers 503
    READY = "ready"
    DRAINING = "draining"  # shutdown began: no new work, in-flight work finishing
    FAILED = "failed"  # the model could not be loaded


@dataclass(slots=True, frozen=True)
class LoadedModel:
    """The engine and what the server derives from it once, at load."""

    engine: Any  # the started AsyncLLM
    name: str  # served model id
    limits: RequestLimits  # request caps
    max_model_len: int  # longest prompt + output
    aliases: tuple[str, ...] = ()  # every name the model answers to (name first); /v1/models lists them


@dataclass(slots=True, eq=False)
class ServerState:
    """Mutable state of one app (never module-global, so several apps can coexist in a process)."""

    config: CllmConfig  # settings the server was started with
    loaded: LoadedModel | None = None  # set once the engine is loaded and started
    phase: Phase = Phase.LOADING
    load_error: str | None = None  # why loading failed
    started_at: int = field(default_factory=lambda: int(time.time()))  # for /v1/models `created`
    metrics: ServerMetrics = field(init=False)
    loop: asyncio.AbstractEventLoop | None = None  # the serving loop, captured at startup
    load_task: asyncio.Task[None] | None = None  # background model load
    shutdown_task: asyncio.Task[None] | None = None  # engine drain, once begun
    on_fatal: Callable[[str], None] | None = None  # asks the process to exit (set by run_server)
    quota: ClientQuota = field(init=False)  # per-request and per-client sequence caps

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine_stats)
        server = self.config.server
        self.quota = ClientQuota(AdmissionPolicy(
            max_sequences_per_request=server.max_sequences_per_request,
            max_sequences_per_client=server.max_sequences_per_client,
            allow_client_priority=server.allow_client_priority,
            max_compiles_per_client=server.max_compiles_per_client,
        ))

    def engine_stats(self) -> Any | None:
        """The engine's stats, or None before it is loaded."""
        return self.loaded.engine.stats() if self.loaded is not None else None

    def require_loaded(self) -> LoadedModel:
        """The model, whatever the phase (tokenizer, stats); 503 before it is loaded."""
        if self.loaded is None:
            raise self._unavailable()
        return self.loaded

    def require_ready(self) -> LoadedModel:
        """The model, if it may take new work; else a 503 APIError saying why."""
        if self.phase is not Phase.READY or self.loaded is None:
            raise self._unavailable()
        return self.loaded

    def _unavailable(self) -> APIError:
        reasons = {
            Phase.LOADING: ("the model is still loading; retry shortly", "model_loading"),
            Phase.DRAINING: ("the server is shutting down", "shutting_down"),
            Phase.FAILED: (f"the model failed to load: {self.load_error}", "model_load_failed"),
        }
        message, code = reasons.get(self.phase, ("engine unavailable", "engine_unavailable"))
        headers = {"Retry-After": "2"} if self.phase is Phase.LOADING else None
        return APIError(503, message, code=code, headers=headers)

    def check_model(self, requested: str | None, *, param: str = "model") -> None:
        """A request's ``model`` must be omitted or name a served alias (any name with accept_any_model);
        404 model_not_found otherwise."""
        names = (self.loaded.aliases or (self.loaded.name,)) if self.loaded is not None else ()
        if not requested or requested in names or self.config.server.accept_any_model:
            return
        served = ", ".join(repr(n) for n in names)
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served}",
            param=param,
            code="model_not_found",
        )


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving ``request``."""
    state: ServerState = request.app.state.cllm
    return state
