"""Everything one server app holds: config, engine, phase, metrics. Lives on ``app.state.cllm``."""
from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from cllm.config import CllmConfig, parse_keep_alive
from cllm.multimodal import accepts_images
from cllm.router import ModelNotFound, ModelSpec, ModelUnavailable, Router
from cllm.server.body_limit import IMAGE_BODY_BYTES, TEXT_BODY_BYTES
from cllm.server.client_quota import AdmissionPolicy, ClientQuota
from cllm.server.errors import APIError
from cllm.server.images import ImageMemory
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
    """A loaded model's engine and what the server derives from it once, at load."""

    engine: Any  # the started AsyncLLM (or ProcessEngine)
    name: str  # served model id
    limits: RequestLimits  # request caps
    max_model_len: int  # longest prompt + output
    aliases: tuple[str, ...] = ()  # every name the model answers to (name first); /v1/models lists them


LEASES_KEY = "cllm_model_leases"  # where a request's model leases wait in its ASGI scope state for release


@dataclass(slots=True, eq=False)
class ServerState:
    """Mutable state of one app (never module-global, so several apps can coexist in a process)."""

    config: CllmConfig  # settings the server was started with
    specs: list[ModelSpec]  # the models it serves (one unless several are declared)
    single: bool = True  # one model for the server's whole life (none declared): its failure is the server's
    router: Router | None = None  # set at startup
    phase: Phase = Phase.LOADING
    load_error: str | None = None  # why loading failed
    started_at: int = field(default_factory=lambda: int(time.time()))  # for /v1/models `created`
    metrics: ServerMetrics = field(init=False)
    loop: asyncio.AbstractEventLoop | None = None  # the serving loop, captured at startup
    load_task: asyncio.Task[None] | None = None  # background model load
    shutdown_task: asyncio.Task[None] | None = None  # engine drain, once begun
    on_fatal: Callable[[str], None] | None = None  # asks the process to exit (set by run_server)
    quota: ClientQuota = field(init=False)  # per-request and per-client sequence caps
    image_memory: ImageMemory = field(init=False)  # decoded images held by requests in flight (images.image_memory_mib)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine_stats)
        server = self.config.server
        self.quota = ClientQuota(AdmissionPolicy(
            max_sequences_per_request=server.max_sequences_per_request,
            max_sequences_per_client=server.max_sequences_per_client,
            allow_client_priority=server.allow_client_priority,
            max_compiles_per_client=server.max_compiles_per_client,
        ))
        self.image_memory = ImageMemory(self.config.images.image_memory_mib << 20)

    @property
    def loaded(self) -> LoadedModel | None:
        """The default (first) model if it is loaded."""
        return self.router.served_of(None) if self.router is not None else None

    def max_body_bytes(self) -> int:
        """The largest request body now: ``server.max_body_bytes``, or when it is null 1 MiB, and 32 MiB while
        a loaded model takes images (a phone photo inline as base64 is several MiB)."""
        if self.config.server.max_body_bytes is not None:
            return self.config.server.max_body_bytes
        takes_images = self.router is not None and any(accepts_images(engine) for _, engine in self.router.loaded())
        return IMAGE_BODY_BYTES if takes_images else TEXT_BODY_BYTES

    def engine_stats(self) -> list[tuple[str, Any]]:
        """(model name, engine stats) of every loaded model."""
        if self.router is None:
            return []
        stats = [(spec.name, engine.stats()) for spec, engine in self.router.loaded()]
        return [(name, s) for name, s in stats if s is not None]  # (a remote engine before its first report)

    async def model_for(self, request: Request, requested: str | None, *, param: str = "model",
                        keep_alive: object = None) -> LoadedModel:
        """The model a request names (``model`` omitted: the default), loaded if need be, leased until the
        request's response is sent (ModelLeaseMiddleware). 404 model_not_found for an unknown name (any
        name is the default with accept_any_model), 503 with Retry-After while it cannot serve."""
        if self.phase is not Phase.READY or self.router is None:
            raise self._unavailable()
        keep_s = None
        if keep_alive is not None:
            try:
                keep_s = parse_keep_alive(keep_alive)
            except ValueError as err:
                raise APIError(400, str(err), param="keep_alive") from None
        try:
            self.router.spec_for(requested)
        except ModelNotFound as err:
            if not self.config.server.accept_any_model:
                raise APIError(404, str(err), param=param, code="model_not_found") from None
            requested = None
        try:
            lease = await self.router.acquire(requested, keep_alive_s=keep_s)
        except ModelUnavailable as err:
            raise unavailable_error(err) from None
        request.scope.setdefault("state", {}).setdefault(LEASES_KEY, []).append(lease)
        served: LoadedModel = lease.served
        return served

    def check_model(self, requested: str | None, *, param: str = "model") -> ModelSpec:
        """The declared model ``requested`` names (None: the default); 404 model_not_found otherwise."""
        try:
            return self.router.spec_for(requested) if self.router is not None else self.specs[0]
        except ModelNotFound as err:
            if self.config.server.accept_any_model:
                return self.specs[0]
            raise APIError(404, str(err), param=param, code="model_not_found") from None

    def _unavailable(self) -> APIError:
        reasons = {
            Phase.LOADING: ("the model is still loading; retry shortly", "model_loading"),
            Phase.DRAINING: ("the server is shutting down", "shutting_down"),
            Phase.FAILED: (f"the model failed to load: {self.load_error}", "model_load_failed"),
        }
        message, code = reasons.get(self.phase, ("engine unavailable", "engine_unavailable"))
        headers = {"Retry-After": "2"} if self.phase is Phase.LOADING else None
        return APIError(503, message, code=code, headers=headers)


def unavailable_error(err: ModelUnavailable) -> APIError:
    """A model that cannot take a request now: 503 with its code and Retry-After."""
    headers = {"Retry-After": str(math.ceil(err.retry_after_s))} if err.retry_after_s else None
    return APIError(503, str(err), code=err.code, headers=headers)


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving ``request``."""
    state: ServerState = request.app.state.cllm
    return state
