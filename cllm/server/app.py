"""The FastAPI app (`create_app`) and the uvicorn process around it (`run_server`)."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from cllm.config import KEEP_FOREVER, CllmConfig
from cllm.server.access_log import AccessLogMiddleware, AccessRecord
from cllm.server.anthropic_errors import AnthropicErrorMiddleware
from cllm.router import declared_models
from cllm.server.auth import ApiKeyMiddleware
from cllm.server.body_limit import BodyLimitMiddleware
from cllm.server.errors import install_error_handlers
from cllm.server.fingerprint import system_fingerprint
from cllm.server.host_guard import LOOPBACK_HOSTS, HostGuardMiddleware
from cllm.server.lifecycle import lifespan_for, request_drain
from cllm.server.model_leases import ModelLeaseMiddleware
from cllm.server.routes import KNOWN_PATHS, routers
from cllm.server.slow_clients import header_limits_protocol
from cllm.server.state import ServerState

log = logging.getLogger("cllm.server")

# Extra time uvicorn gives connections beyond the engine's grace, so requests the
# engine aborts at the deadline can still send their last bytes before being cut.
_CONNECTION_GRACE_MARGIN_S = 3.0


def create_app(config: CllmConfig, engine: Any | None = None, engines: dict[str, Any] | None = None) -> FastAPI:
    """The OpenAI-compatible app.

    With ``engine`` None the app builds ``AsyncLLM(config=config)`` in a thread at
    startup (``/health`` answers 503 until it is ready); a given engine is
    started at startup and shut down with the app. ``engines`` (by declared model
    name: Ray Serve's replica sets) are the models of a multi-model app, loaded
    for its whole life. All state lives on ``app.state.cllm`` — two apps in one
    process share nothing.
    """
    specs = declared_models(config)
    if engines is not None:
        specs = [dataclasses.replace(s, keep_alive_s=KEEP_FOREVER, preload=True) for s in specs]
    state = ServerState(config=config, specs=specs, single=not (config.models or config.router.models_dir))
    app = FastAPI(
        title="cllm",
        summary="OpenAI-compatible LLM server with continuous batching",
        lifespan=lifespan_for(state, engine, engines),
        docs_url="/docs",
        redoc_url=None,
        **_telemetry_settings(),
    )
    app.state.cllm = state
    app.state.system_fingerprint = system_fingerprint(config)  # one value for the process's whole life
    install_error_handlers(app)
    for router in routers():
        app.include_router(router)

    def count_response(record: AccessRecord) -> None:
        route = record.path if record.path in KNOWN_PATHS else "other"
        state.metrics.http_responses.labels(route=route, code=str(record.status or 499)).inc()

    # Added innermost first: the body limit sees requests after logging and CORS.
    app.add_middleware(ModelLeaseMiddleware)  # innermost: a request's model leases end with its response
    app.add_middleware(BodyLimitMiddleware, limit=state.max_body_bytes,
                       in_flight_bytes=config.server.max_body_bytes_in_flight, timeout_s=config.server.body_read_timeout_s)
    if config.server.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.server.api_key)
    else:
        app.add_middleware(HostGuardMiddleware, allowed=config.server.allowed_hosts)
    if config.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.server.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    # Outside everything that can refuse a request, so every error on /v1/messages is Anthropic-shaped.
    app.add_middleware(AnthropicErrorMiddleware)
    app.add_middleware(AccessLogMiddleware, on_done=count_response)
    return app


def _telemetry_settings() -> dict[str, Any]:
    """FastAPI's native OpenTelemetry (0.16x+) asks the global providers on every request whether any is
    configured (~2 % of the API process's loop at 256 streams, an environment read among it); turn it off
    unless the process was started with OpenTelemetry configured (an ``OTEL_*`` variable)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters or any(k.startswith("OTEL_") for k in os.environ):
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


class _DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT drain the engine at once and end the process with status 0.

    Stock uvicorn re-raises the signal after its graceful shutdown, so a
    drained SIGTERM would still exit with -15; a clean drain is a clean exit.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C stops waiting for connections
        else:
            self.should_exit = True
        request_drain(self._state)

    def fail(self, reason: str) -> None:
        """Stop the server with a non-zero status (the model could not be loaded)."""
        log.error("exiting with status 1 (%s)", reason.split(":", 1)[0])  # the reason itself was logged at the failure
        self.exit_code = 1
        self.should_exit = True


def uvicorn_config(app: FastAPI, config: CllmConfig) -> uvicorn.Config:
    """uvicorn's settings for serving ``app`` as ``config`` says."""
    server_cfg = config.server
    return uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.log_level,
        log_config=None,
        access_log=False,  # AccessLogMiddleware writes one richer line per request
        lifespan="on",
        timeout_graceful_shutdown=int(server_cfg.shutdown_grace_s + _CONNECTION_GRACE_MARGIN_S),
        # Slow and greedy clients (issue 9 defect 14): idle keep-alives, header size and time, and
        # how many connections and requests are open at once (beyond it, 503).
        http=header_limits_protocol(header_timeout_s=server_cfg.header_read_timeout_s,
                                    max_header_bytes=server_cfg.max_header_bytes,
                                    write_timeout_s=server_cfg.stream_stall_timeout_s),  # a reader that stalls
        timeout_keep_alive=server_cfg.keep_alive_timeout_s,  # type: ignore[arg-type]  # call_later takes floats
        limit_concurrency=server_cfg.max_connections,
        loop="cllm.server.accept_loop:new_event_loop",  # uvloop (or asyncio), accepting connections in batches
    )


def configure_logging(level: str) -> None:
    """Root logging for the server process (uvicorn's loggers propagate to it)."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def run_server(config: CllmConfig) -> None:
    """Serve ``config`` until SIGTERM/SIGINT; exit status 1 if the model fails to load."""
    server_cfg = config.server
    configure_logging(server_cfg.log_level)
    if server_cfg.api_key is None and server_cfg.host.lower() not in LOOPBACK_HOSTS:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                    "set --api-key (or CLLM_API_KEY). Requests must also carry a Host header in allowed_hosts",
                    server_cfg.host)
    app = create_app(config)
    server = _DrainingServer(uvicorn_config(app, config), app.state.cllm)
    app.state.cllm.on_fatal = server.fail
    log.info("cllm serving on http://%s:%d (model loading in the background)", server_cfg.host, server_cfg.port)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)
