"""Engine lifecycle under the server: load in the background, drain on shutdown.

Loading takes seconds and blocks, so it runs in a worker thread while the
server already answers ``/health`` with 503. Shutdown is a drain: new work is
refused at once (503), in-flight requests get up to ``shutdown_grace_s`` to
finish, then the engine aborts the rest and frees everything.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from cllm.config import CllmConfig
from cllm.gc_freeze import freeze_live_objects
from cllm.progress import model_load_phase
from cllm.router import ModelSpec, Router
from cllm.server.ready import ready_lines, ready_lines_models
from cllm.server.sampling import RequestLimits
from cllm.server.state import LoadedModel, Phase, ServerState

log = logging.getLogger("cllm.server")


def _construct_engine(config: CllmConfig) -> Any:
    """The engine in a process of its own where that pays (server.engine_process), else on a thread here."""
    from cllm.engine.async_llm import AsyncLLM  # imported here: it pulls in the backends
    from cllm.engine.process_engine import EngineProcessUnavailable, ProcessEngine, wants_engine_process

    with model_load_phase(config):
        if wants_engine_process(config):
            try:
                return ProcessEngine(config)
            except EngineProcessUnavailable as err:
                if config.server.engine_process == "on":
                    raise
                log.warning("%s; running it on a thread of this process instead (engine_process: auto)", err)
        return AsyncLLM(config=config)


def _construct(spec: ModelSpec) -> Any:
    return _construct_engine(spec.config)  # (looked up at call time: tests replace it)


def _served(config: CllmConfig, spec: ModelSpec, engine: Any) -> LoadedModel:
    """What the server keeps of a loaded model: its engine, names and request caps."""
    limits = RequestLimits(
        max_tokens_limit=config.server.max_tokens_limit,
        max_n=config.server.max_n,
        vocab_size=engine.tokenizer.vocab_size,
    )
    return LoadedModel(engine=engine, name=spec.name, limits=limits, max_model_len=engine.max_model_len,
                       aliases=spec.aliases)


def make_router(state: ServerState, engine: Any | None, engines: dict[str, Any] | None = None) -> Router:
    """The server's router over its declared models (a given engine serves the one model; given engines,
    theirs)."""
    construct = (lambda spec: engine) if engine is not None else _construct
    if engines is not None:
        construct = lambda spec: engines[spec.name]  # noqa: E731
    return Router(config=state.config, specs=state.specs, construct=construct,
                  wrap=lambda spec, eng: _served(state.config, spec, eng), revive_dead=not state.single)


async def start_models(state: ServerState) -> None:
    """Single model: load it (phase LOADING until then; a failure marks FAILED and asks the process to
    exit). Several: open for traffic at once, the models marked preload loading in the background."""
    router = state.router
    assert router is not None  # set by the lifespan before this runs
    if not state.single:
        state.phase = Phase.READY
        _write_ready(ready_lines_models(state.config, router.models()))
        failures = await router.start()
        for name, err in failures.items():
            log.error("model %r could not be preloaded (%s); its requests get 503 until it loads", name, err)
        return
    failures = await router.start()
    if state.phase is Phase.DRAINING:
        return
    if failures:
        state.phase = Phase.FAILED
        state.load_error = router.failure_of(None) or str(next(iter(failures.values())))
        log.error("failed to load the model: %s", state.load_error)
        if state.on_fatal is not None:
            state.on_fatal(state.load_error)
        return
    freeze_live_objects()
    state.phase = Phase.READY
    model = state.loaded
    assert model is not None
    log.info("model %s ready (max_model_len=%d)", model.name, model.max_model_len)
    # The person's ready line: where to chat, where the API is, what runs, a curl to try.
    _write_ready(ready_lines(state.config, model.engine, model.name, model.max_model_len))


def _write_ready(lines: list[str]) -> None:
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def begin_drain(state: ServerState) -> None:
    """Stop admitting work and start the engines' graceful shutdown. Idempotent; call on the loop."""
    if state.phase is not Phase.FAILED:
        state.phase = Phase.DRAINING
    if state.router is not None and state.shutdown_task is None:
        grace = state.config.server.shutdown_grace_s
        log.info("shutting down: in-flight requests have %.1fs to finish", grace)
        state.shutdown_task = asyncio.ensure_future(state.router.shutdown(grace))


def request_drain(state: ServerState) -> None:
    """Thread- and signal-safe: schedule ``begin_drain`` on the serving loop."""
    if state.loop is not None and not state.loop.is_closed():
        state.loop.call_soon_threadsafe(begin_drain, state)


async def finish_shutdown(state: ServerState) -> None:
    """End of the app's life: drain (if not begun), wait for it, and for a load still in progress."""
    begin_drain(state)
    if state.load_task is not None and not state.load_task.done():
        # A model thread cannot be interrupted; wait for it so its engine is shut down too.
        with contextlib.suppress(Exception):
            await state.load_task
    if state.shutdown_task is not None:
        try:
            await state.shutdown_task
        except Exception as exc:
            log.error("engine shutdown failed: %s", exc, exc_info=exc)
    log.info("shutdown complete")


def lifespan_for(state: ServerState, engine: Any | None, engines: dict[str, Any] | None = None) -> Any:
    """The FastAPI lifespan: load the models at startup (in the background), drain at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        state.router = make_router(state, engine, engines)
        if engine is not None or engines is not None:
            await start_models(state)  # a given engine is ready at once (its server is up when startup ends)
        else:
            state.load_task = asyncio.create_task(start_models(state))
        try:
            yield
        finally:
            await finish_shutdown(state)

    return lifespan
