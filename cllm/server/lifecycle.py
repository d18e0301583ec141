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
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from cllm.config import CllmConfig
from cllm.gc_freeze import freeze_live_objects
from cllm.progress import model_load_phase
from cllm.server.ready import ready_lines
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


def _served_names(config: CllmConfig, engine: Any) -> tuple[str, ...]:
    if config.server.served_model_name:
        return tuple(config.server.served_model_name)
    name = getattr(engine, "model_name", None)
    return (str(name) if name else Path(str(config.model.model or "model")).stem,)


def attach_engine(state: ServerState, engine: Any) -> None:
    """Start a loaded engine and open for traffic (or drain it at once if shutdown already began)."""
    engine.start()
    limits = RequestLimits(
        max_tokens_limit=state.config.server.max_tokens_limit,
        max_n=state.config.server.max_n,
        vocab_size=engine.tokenizer.vocab_size,
    )
    names = _served_names(state.config, engine)
    state.loaded = LoadedModel(
        engine=engine, name=names[0], limits=limits, max_model_len=engine.max_model_len, aliases=names
    )
    if state.phase is Phase.DRAINING:
        begin_drain(state)
        return
    freeze_live_objects()
    state.phase = Phase.READY
    log.info("model %s ready (max_model_len=%d)", state.loaded.name, state.loaded.max_model_len)
    # The person's ready line: where to chat, where the API is, what runs, a curl to try.
    sys.stderr.write("\n".join(ready_lines(state.config, engine, state.loaded.name, state.loaded.max_model_len)) + "\n")
    sys.stderr.flush()


async def load_engine(state: ServerState) -> None:
    """Construct the engine in a thread; on failure mark FAILED and ask the process to exit."""
    try:
        engine = await asyncio.to_thread(_construct_engine, state.config)
    except Exception as exc:
        # A bad model file or setting is said in one line (its message names the value and the fix);
        # a traceback only for what nobody foresaw, or at debug level.
        foreseen = isinstance(exc, (ValueError, FileNotFoundError))
        log.error("failed to load the model: %s", exc, exc_info=None if foreseen else exc)
        if foreseen:
            log.debug("the load failure's traceback", exc_info=exc)
        state.phase = Phase.FAILED
        state.load_error = f"{type(exc).__name__}: {exc}"
        if state.on_fatal is not None:
            state.on_fatal(state.load_error)
        return
    attach_engine(state, engine)


def begin_drain(state: ServerState) -> None:
    """Stop admitting work and start the engine's graceful shutdown. Idempotent; call on the loop."""
    if state.phase is not Phase.FAILED:
        state.phase = Phase.DRAINING
    if state.loaded is not None and state.shutdown_task is None:
        grace = state.config.server.shutdown_grace_s
        log.info("shutting down: in-flight requests have %.1fs to finish", grace)
        state.shutdown_task = asyncio.ensure_future(state.loaded.engine.shutdown(grace))


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


def lifespan_for(state: ServerState, engine: Any | None) -> Any:
    """The FastAPI lifespan: attach or load the engine at startup, drain at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        if engine is not None:
            attach_engine(state, engine)
        else:
            state.load_task = asyncio.create_task(load_engine(state))
        try:
            yield
        finally:
            await finish_shutdown(state)

    return lifespan
