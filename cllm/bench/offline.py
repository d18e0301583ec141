"""In-process target: a cllm engine (any backend) driven through ``cllm.AsyncLLM``.

Requests go in as token ids (the workload's exact prompt), so no tokenizer
round trip blurs the comparison between backends. Timestamps are taken as each
streamed output reaches this coroutine, i.e. what a Python caller observes.
"""
from __future__ import annotations

import time
from typing import Any

from cllm.bench.metrics import RequestRecord, StreamTimer
from cllm.bench.workload import BenchPrompt, GenerationSettings


def engine_overrides(*, max_concurrency: int, n_threads: int | None, n_ctx: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flat config overrides for a benchmark engine: enough sequence slots for the load."""
    overrides: dict[str, Any] = {"n_seq_max": max(1, min(256, max_concurrency))}
    if n_threads is not None:
        overrides["n_threads"] = n_threads
    if n_ctx is not None:
        overrides["n_ctx"] = n_ctx
    overrides.update(extra or {})
    return overrides


class EngineTarget:
    """A ``cllm.AsyncLLM`` running in this process and event loop."""

    def __init__(self, engine: Any, name: str) -> None:
        self.name = name  # label in tables
        self._engine = engine

    @classmethod
    def open(cls, *, backend: str, model: str | None, overrides: dict[str, Any], name: str | None = None) -> EngineTarget:
        """Load the model and start the engine (call from inside the running event loop)."""
        import cllm

        engine = cllm.AsyncLLM(model=model, backend=backend, **overrides)
        engine.start()
        return cls(engine, name or backend)

    async def send(self, prompt: BenchPrompt, settings: GenerationSettings, run_start: float) -> RequestRecord:
        """Stream one request through the engine and time its outputs."""
        from cllm import SamplingParams

        params = SamplingParams(
            max_tokens=prompt.output_len, temperature=settings.temperature,
            ignore_eos=settings.ignore_eos, seed=settings.seed + prompt.index,
        )
        timer = StreamTimer.begin(prompt.index, len(prompt.token_ids), prompt.output_len, run_start, time.perf_counter())
        try:
            final = None
            async for out in self._engine.generate(list(prompt.token_ids), params):
                now = time.perf_counter()
                if out.outputs and out.outputs[0].token_ids_delta:
                    timer.chunk(now)
                final = out
            now = time.perf_counter()
        except Exception as exc:  # one failed request is a result, not a crash
            return timer.fail(time.perf_counter(), f"{type(exc).__name__}: {exc}")
        return _finish(timer, final, now)

    async def close(self) -> None:
        """Shut the engine down, aborting anything still running."""
        await self._engine.shutdown(0)


def _finish(timer: StreamTimer, final: Any, now: float) -> RequestRecord:
    """Record the outcome of a finished stream."""
    if final is None:
        return timer.fail(now, "engine returned no output")
    choice = final.outputs[0] if final.outputs else None
    if final.error or choice is None or choice.finish_reason in ("error", "abort", "timeout"):
        reason = final.error or (f"finish_reason={choice.finish_reason}" if choice else "no choices")
        return timer.fail(now, reason)
    return timer.finish(now, output_tokens=len(choice.token_ids))
