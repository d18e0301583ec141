"""The engine work behind one HTTP request: one engine request per prompt, merged.

``GenerationStream`` starts them, yields ``(prompt_index, RequestOutput)`` as
any of them makes progress (or nothing for a while: keep-alive ticks), records
latency metrics and the access-log totals, and on ``close()`` aborts whatever
has not finished (closing an engine stream aborts its request and frees its
slot) and gives the client's share of the queue back.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cllm.outputs import RequestOutput, merge_outputs
from cllm.sampling.params import SamplingParams
from cllm.server.access_log import AccessRecord
from cllm.server.client_quota import ClientLease
from cllm.server.errors import APIError, engine_error
from cllm.server.metrics import ModelMetrics

log = logging.getLogger("cllm.server")
Prompt = str | list[int]
_ABNORMAL = ("timeout", "abort", "error")
DEFAULT_STALL_TIMEOUT_S = 120.0  # ServerConfig.stream_stall_timeout_s when the engine has no server config


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


class StreamEnd:
    """Marks the end of every prompt's engine stream."""


STREAM_END = StreamEnd()
_QUIET = object()  # queued by the keep-alive timer: no output for the consumer's timeout
_Item = tuple[int, RequestOutput | None, BaseException | None]  # (prompt index, output, error); (i, None, None) = ended


class StreamStalledError(RuntimeError):
    """The reader took nothing for stream_stall_timeout_s while output waited: its requests are aborted."""


class _Mailbox:
    """What the pumps hand the consumer: like an unbounded asyncio.Queue, except that an output put
    while an earlier output of the same prompt still waits is merged into it (deltas concatenated, at
    the earlier one's place). A reader that stops reading thus holds one pending output per prompt,
    growing by the text of the tokens it has not read, never one object per step (issue 27 item 2)."""

    def __init__(self) -> None:
        self._items: collections.deque[list[Any]] = collections.deque()  # [item] boxes, in order
        self._open: dict[int, list[Any]] = {}  # prompt index -> its box still waiting, if mergeable
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put(self, item: Any) -> None:
        if isinstance(item, tuple) and item[1] is not None and item[2] is None:
            box = self._open.get(item[0])
            if box is not None:
                box[0] = (item[0], merge_outputs(box[0][1], item[1]), None)
                if item[1].finished:
                    del self._open[item[0]]
                return
            box = [item]
            if not item[1].finished:
                self._open[item[0]] = box
        else:
            box = [item]
            if isinstance(item, tuple):
                self._open.pop(item[0], None)  # an end or an error: nothing merges past it
        self._items.append(box)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        """The oldest item; cancelling the wait takes nothing (as asyncio.Queue.get)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        box = self._items.popleft()
        item = box[0]
        if isinstance(item, tuple) and self._open.get(item[0]) is box:
            del self._open[item[0]]
        return item


class GenerationStream:
    """Engine outputs for the prompts of one HTTP request. Use ``start()``, iterate, ``close()``.

    Each prompt's engine stream is pumped by a task into one queue, so the consumer can wait for
    the next output with a timeout (SSE keep-alives) without cancelling an engine stream mid-step,
    and cancelling the pumps closes the engine streams, which aborts their requests.
    """

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        *,
        request_id: str,
        priority: int,
        metrics: ModelMetrics,
        record: AccessRecord | None,
        prompt_param: str,
        lease: ClientLease | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self._queue = _Mailbox()
        if stall_timeout_s is None:  # the engine's config is the server's (AsyncLLM, RemoteEngine)
            server = getattr(getattr(engine, "config", None), "server", None)
            stall_timeout_s = getattr(server, "stream_stall_timeout_s", DEFAULT_STALL_TIMEOUT_S)
        self._stall_timeout_s = stall_timeout_s
        self._taken_at = time.monotonic()  # the reader last took an output (or the stream began)
        # When the oldest item still in the queue was put there (a put into an empty queue): a reader
        # waiting in next_output takes it at once, so only output left this long in a queue whose
        # reader also took nothing this long is a stall. The time since the last take alone made a
        # collector that waited long for its first outputs "stalled" (issue 46 item 2: a non-streamed
        # request of several prompts got a 408 when the second prompt's output found the first's queued).
        self._waiting_since = self._taken_at
        self.stalled = False  # the reader stalled and the requests were aborted
        self._pending: list[_Item] = []
        self._remaining = len(prompts)  # engine streams not ended yet
        self._unqueued = len(prompts)  # prompts the engine has not queued yet
        self._news: asyncio.Future[None] | None = None  # what start() waits on: queued, or an output or error came
        self._metrics = metrics
        self._record = record
        self._prompt_param = prompt_param
        self._lease = lease
        self._last_token_at: list[float | None] = [None] * len(prompts)
        self.finals: list[RequestOutput | None] = [None] * len(prompts)  # each prompt's final output
        self._closed = False
        self._quiet_timer: asyncio.TimerHandle | None = None  # see _arm_quiet_timer
        self._last_item_at = time.monotonic()
        self.num_choices = params.n
        # Each prompt's outputs come straight from the engine's reader where it can hand them over
        # (ProcessEngine.open_stream: no task per output); otherwise a task pumps its engine stream.
        self._closers: list[Callable[[], None] | None] = [None] * len(prompts)
        opener = getattr(engine, "open_stream", None)
        # One prompt is opened by start() in the caller's task (its request reaches the engine in the same
        # event-loop iteration): a task of its own started an iteration later, on every request's critical
        # path (~5-10 ms an iteration at 256 streams). Several prompts open concurrently, a task each.
        self._inline: tuple | None = None
        if opener is not None and len(prompts) == 1:
            self._inline = (opener, prompts[0], params, ids[0], priority)
            self._tasks: list[asyncio.Future[None]] = []
        else:
            self._tasks = [
                asyncio.ensure_future(self._open(i, opener, p, params, rid, priority) if opener is not None else
                                      self._pump(i, engine.generate(p, params, request_id=rid, priority=priority,
                                                                    on_queued=self._on_queued)))
                for i, (p, rid) in enumerate(zip(prompts, ids))
            ]

    def _on_queued(self) -> None:
        self._unqueued -= 1
        if self._unqueued == 0:
            self._tell_start()

    def _tell_start(self) -> None:
        if self._news is not None and not self._news.done():
            self._news.set_result(None)

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            # Closing the engine stream explicitly (not at garbage collection) is what aborts it.
            async with contextlib.aclosing(gen) as stream:  # type: ignore[type-var]
                async for out in stream:
                    now = time.monotonic()
                    self._last_item_at = now
                    if self._queue and now - max(self._taken_at, self._waiting_since) > self._stall_timeout_s:
                        raise StreamStalledError(
                            f"the client read nothing for {self._stall_timeout_s:g} s (stream_stall_timeout_s) while "
                            "output waited: request aborted")
                    self._put((index, out, None))
        except StreamStalledError as exc:  # the engine stream is closed (aborted) by now: end the others too
            self._on_stall(index, exc)
            return
        except Exception as exc:  # handed to the consumer, which decides the response
            self._put((index, None, exc))
            return
        self._put((index, None, None))

    async def _open(self, index: int, opener: Callable[..., Any], prompt: Prompt, params: SamplingParams, request_id: str,
                    priority: int) -> None:
        """Register prompt ``index`` with the engine, its outputs going to :meth:`_take` (a refusal is queued)."""
        try:
            self._closers[index] = await opener(prompt, params, request_id=request_id, priority=priority,
                                                on_queued=self._on_queued, sink=functools.partial(self._take, index))
        except Exception as exc:  # handed to the consumer, which decides the response
            self._put((index, None, exc))

    def _take(self, index: int, item: RequestOutput | BaseException) -> None:
        """The engine's reader: prompt ``index``'s next output, or the exception that ends it (as _pump)."""
        if isinstance(item, BaseException):
            self._put((index, None, item))
            return
        now = time.monotonic()
        self._last_item_at = now
        if self._queue and now - max(self._taken_at, self._waiting_since) > self._stall_timeout_s:
            self._close_engine_stream(index)
            self._on_stall(index, StreamStalledError(
                f"the client read nothing for {self._stall_timeout_s:g} s (stream_stall_timeout_s) while "
                "output waited: request aborted"))
            return
        self._put((index, item, None))
        if item.finished:
            self._put((index, None, None))

    def _close_engine_stream(self, index: int) -> None:
        """End prompt ``index``'s engine stream (an unfinished request is aborted)."""
        self._inline = None  # never opened now
        if self._tasks:
            self._tasks[index].cancel()  # a pump closes its engine stream; an open still running registers nothing
        closer = self._closers[index]
        if closer is not None:
            self._closers[index] = None
            closer()

    def _put(self, item: Any) -> None:
        if self._queue.empty():
            self._waiting_since = time.monotonic()
        self._queue.put(item)
        self._tell_start()

    def _on_stall(self, index: int, exc: StreamStalledError) -> None:
        if not self.stalled:
            self.stalled = True
            log.warning("stream %s: %s", self._record.request_id if self._record is not None else "?", exc)
            for i in range(len(self._closers)):
                if i != index:
                    self._close_engine_stream(i)  # aborts the other prompts' requests
            if self._lease is not None:  # the requests are aborted: their sequences hold the client's share no more
                self._lease.release()  # (the response may stay blocked in its send until the write timeout)
        self._put((index, None, APIError(408, str(exc), code="stream_stalled")))

    async def start(self) -> None:
        """Wait until the engine queued every prompt, or its first output or error came (issue 9 defect 15).

        Admission errors (queue full, prompt too long …) come before the queueing and become HTTP
        errors here; after it, a stream can send its headers at once instead of after the first
        token, which a queued request or a long prefill may take minutes to produce.
        """
        if self._inline is not None:
            inline, self._inline = self._inline, None
            await self._open(0, *inline)
        while self._queue.empty() and self._unqueued:
            self._news = asyncio.get_running_loop().create_future()  # set by _on_queued or _put (one future,
            try:                                                     # not two tasks and an asyncio.wait)
                await self._news
            finally:
                self._news = None
        if self._queue.empty():
            return
        index, out, exc = await self._queue.get()
        if exc is not None:
            raise engine_error(exc, prompt_param=self._prompt_param) from None
        if out is None and self._unqueued:
            raise APIError(500, "the engine ended the request without output", code="internal_error")
        self._pending.append((index, out, exc))

    async def next_output(self, timeout: float | None = None) -> tuple[int, RequestOutput] | StreamEnd | None:
        """The next output; ``STREAM_END`` when every prompt ended; None if ``timeout`` passed first.
        Engine errors come out as APIError."""
        while True:
            if self._pending:
                index, out, exc = self._pending.pop(0)
            elif self._remaining == 0:
                return STREAM_END
            else:
                if timeout is not None:
                    self._arm_quiet_timer(timeout)
                item = await self._queue.get()
                self._taken_at = time.monotonic()
                if item is _QUIET:
                    return None
                index, out, exc = item
            if exc is not None:
                raise engine_error(exc, prompt_param=self._prompt_param) from None
            if out is None:
                self._remaining -= 1
                continue
            self._note(index, out)
            return index, out

    def _arm_quiet_timer(self, timeout: float) -> None:
        """Queue a "nothing for ``timeout`` s" marker when no output comes for that long.

        One timer per quiet period, re-armed from its own callback: a ``wait_for`` around every
        ``get`` made a task and a timer per streamed token (py-spy, one client on a fake backend:
        15 % of the streaming response's samples)."""
        if self._quiet_timer is None:
            self._quiet_timer = asyncio.get_running_loop().call_later(timeout, self._on_quiet, timeout)

    def _on_quiet(self, timeout: float) -> None:
        self._quiet_timer = None
        if self._closed or not self._queue.empty():
            return  # an output is waiting to be taken; next_output re-arms when it waits again
        idle = time.monotonic() - self._last_item_at
        if idle >= timeout:
            self._put(_QUIET)
        else:  # an output came and was taken meanwhile: wait out the rest of the period from it
            self._quiet_timer = asyncio.get_running_loop().call_later(timeout - idle, self._on_quiet, timeout)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come; engine errors come out as APIError."""
        while not isinstance(item := await self.next_output(), StreamEnd):
            if item is not None:
                yield item

    async def collect(self) -> list[RequestOutput]:
        """Run to the end; every prompt's final output."""
        async for _ in self:
            pass
        missing = [i for i, f in enumerate(self.finals) if f is None]
        if missing:
            raise APIError(500, f"the engine ended prompt(s) {missing} without a final output", code="internal_error")
        return [f for f in self.finals if f is not None]

    async def close(self) -> None:
        """Abort unfinished engine requests and give the client's share back (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
        # Everything but the wait happens before the first await: when the client left, the response
        # is being cancelled, and anyio cancels every await in its scope again.
        for i in range(len(self._closers)):
            self._close_engine_stream(i)  # aborts the request if unfinished
        if self._lease is not None:
            self._lease.release()
        unfinished = sum(1 for f in self.finals if f is None)
        if unfinished:
            # Closed before the engine reported an end: the client left or the response failed.
            self._metrics.count_requests("abort", unfinished)
        await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))

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
