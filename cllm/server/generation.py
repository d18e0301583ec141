"""The engine work behind one HTTP request: one engine request per prompt, merged.

``GenerationStream`` starts them, yields ``(prompt_index, RequestOutput)`` as
any of them makes progress, records latency metrics and the access-log
totals, and on ``close()`` aborts whatever has not finished (closing an
engine stream aborts its request and frees its slot).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from cllm.outputs import RequestOutput
from cllm.sampling.params import SamplingParams
from cllm.server.access_log import AccessRecord
from cllm.server.errors import APIError, engine_error
from cllm.server.metrics import ServerMetrics

Prompt = str | list[int]
_ABNORMAL = ("timeout", "abort", "error")


def request_status(out: RequestOutput) -> str:
    """One word for how an engine request ended: its worst choice's finish reason.

    ``out.error`` only explains an abnormal end (a timeout carries one too), so
    the finish reasons decide; an error with no abnormal reason is a failure.
    """
    reasons = [o.finish_reason for o in out.outputs]
    for bad in _ABNORMAL:
        if bad in reasons:
            return bad
    if out.error:
        return "error"
    return (reasons[0] or "stop") if reasons else "stop"


async def _merge(gens: Sequence[AsyncIterator[RequestOutput]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several engine streams in arrival order; cancelling tasks on exit closes them all."""
    if len(gens) == 1:
        # Closing the engine stream explicitly (not at garbage collection) is what aborts it.
        async with contextlib.aclosing(gens[0]) as gen:  # type: ignore[type-var]
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen) as stream:  # type: ignore[type-var]
                async for out in stream:
                    queue.put_nowait((index, out, None))
        except Exception as exc:  # handed to the consumer, which decides the response
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            index, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GenerationStream:
    """Engine outputs for the prompts of one HTTP request. Use ``start()``, iterate, ``close()``."""

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        *,
        request_id: str,
        priority: int,
        metrics: ServerMetrics,
        record: AccessRecord | None,
        prompt_param: str,
    ) -> None:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        gens = [engine.generate(p, params, request_id=rid, priority=priority) for p, rid in zip(prompts, ids)]
        self._merged = _merge(gens)
        self._metrics = metrics
        self._record = record
        self._prompt_param = prompt_param
        self._pending: tuple[int, RequestOutput] | None = None
        self._last_token_at: list[float | None] = [None] * len(prompts)
        self.finals: list[RequestOutput | None] = [None] * len(prompts)  # each prompt's final output
        self._closed = False
        self.num_choices = params.n

    async def start(self) -> None:
        """Wait for the first output, so admission errors (queue full, too long …) become HTTP errors."""
        try:
            self._pending = await self._merged.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without output", code="internal_error") from None
        except Exception as exc:
            raise engine_error(exc, prompt_param=self._prompt_param) from None

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come; engine errors after the start come out as APIError."""
        if self._pending is not None:
            item, self._pending = self._pending, None
            self._note(*item)
            yield item
        try:
            async for index, out in self._merged:
                self._note(index, out)
                yield index, out
        except Exception as exc:
            raise engine_error(exc, prompt_param=self._prompt_param) from None

    async def collect(self) -> list[RequestOutput]:
        """Run to the end; every prompt's final output."""
        async for _ in self:
            pass
        missing = [i for i, f in enumerate(self.finals) if f is None]
        if missing:
            raise APIError(500, f"the engine ended prompt(s) {missing} without a final output", code="internal_error")
        return [f for f in self.finals if f is not None]

    async def close(self) -> None:
        """Abort unfinished engine requests (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._merged.aclose()
        unfinished = sum(1 for f in self.finals if f is None)
        if unfinished:
            # Closed before the engine reported an end: the client left or the response failed.
            self._metrics.requests.labels(status="abort").inc(unfinished)

    def _note(self, index: int, out: RequestOutput) -> None:
        now = time.monotonic()
        new_tokens = [len(o.token_ids_delta) for o in out.outputs if o.token_ids_delta]
        if new_tokens:
            last = self._last_token_at[index]
            if last is not None:
                for count in new_tokens:
                    self._metrics.observe_tokens(now - last, count)
            self._last_token_at[index] = now
        if out.finished:
            self.finals[index] = out
            self._metrics.observe_finished(request_status(out), out.metrics)
            self._update_record()

    def _update_record(self) -> None:
        if self._record is None:
            return
        done = [f for f in self.finals if f is not None]
        self._record.prompt_tokens = sum(f.usage.prompt_tokens for f in done)
        self._record.completion_tokens = sum(f.usage.completion_tokens for f in done)
        ttfts = [f.metrics.ttft for f in done if f.metrics.ttft is not None]
        self._record.ttft_s = min(ttfts) if ttfts else None
        self._record.finish = ",".join(sorted({request_status(f) for f in done}))
