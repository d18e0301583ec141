"""AsyncLLM: the engine on a background thread, streaming to many concurrent asyncio callers.

One loop thread owns the LLMEngine. Callers validate their input on their own
side (so bad input raises before anything is queued), then hand the loop a
command through a thread-safe inbox; outputs come back through each request's
asyncio.Queue on the caller's event loop. A caller that stops iterating (break,
cancel, client gone) aborts its request at the start of the next step.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cllm.backends.base import Backend, Tokenizer
from cllm.config import CllmConfig
from cllm.engine.chat_request import attach_tool_calls, prepare_chat
from cllm.engine.llm import make_engine
from cllm.engine.llm_engine import LLMEngine, Prompt
from cllm.engine.prompt_ids import prompt_token_ids
from cllm.multimodal.prompt import MultimodalPrompt
from cllm.engine.stats import EngineStats, RunningRequestInfo
from cllm.errors import EngineDeadError, QueueFullError, RequestHandedOffError
from cllm.gc_freeze import freeze_live_objects
from cllm.handoff.snapshot import RequestSnapshot
from cllm.model_path import resolve_model_path
from cllm.outputs import EmbeddingOutput, RequestOutput, aborted_before_start, merge_outputs
from cllm.sampling.params import SamplingParams

log = logging.getLogger("cllm.engine")
IDLE_WAIT_S = 0.05
# A busy engine republishes its stats snapshot at most this often (building it costs ~0.1 ms, which at
# one token per ~6 ms step was 2 % of a single stream's time); commands and going idle always publish.
PUBLISH_EVERY_S = 0.05
# When requests arrive at an idle engine, the first step waits until no request is being tokenised
# and none has come for BURST_QUIET_S (at most BURST_MAX_WAIT_S), so that a burst (clients whose
# previous requests ended in the same step) is prefilled in one step. Starting at the first arrival
# put the burst's first half into one step and the other half into the next, where it stalled the
# first half's decodes: 64 clients, 16-token outputs: ITL p99 3.6 s (benchmarks/results/performance_log_llama_cpp.md, wave 4).
# A 3 ms quiet window alone still split bursts whose requests sat in tokenisation threads (wave 5);
# counting those lets the window shrink, so a lone request waits BURST_QUIET_S = 1 ms.
# Clients in a closed loop (a benchmark's or an eval harness's N workers) send their next request as
# soon as the last one ends, so one arrival is expected per request finished in the last
# BURST_EXPECT_WITHIN_S: while some are owed, the quiet window is BURST_EXPECT_QUIET_S. With 1 ms
# alone, the bench client's 64 follow-ups (spread over 35-50 ms with 4.5 ms pauses on the 2-core
# Xeon) were split 6 + 58: the 6 decoded beside the 58's 7 s prefill (ITL p99 2-3.7 s) and, ending
# a step early, split the next round the same way.
# On the 2-3x slower AVX2-only EPYC the same 64 follow-ups took over 100 ms to arrive, with gaps up to
# 27 ms: the gather stopped at BURST_MAX_WAIT_S with 28 of 64 in, and the other 36's 4 s prefill stalled
# the 28's decodes (churn ITL p99 2,266 ms vs llama-server's 271). So while arrivals are owed the quiet
# window is 25 ms and the gather may last BURST_EXPECT_MAX_WAIT_S: small beside the burst's prefill
# (64 x 32 prompt tokens: ~8 s there), and never paid by a lone client, whose return clears the debt.
# The same 25 ms window holds once two requests have come in with none owed (N clients starting
# together): with 1 ms the benchmark's opening 64 split 26 + 38 there, and the two groups, ending
# apart, kept splitting every later round.
# Outputs reach a caller's event loop in hand-overs: one callback on the loop with every request's
# output, at most one outstanding per loop. While the loop has not run the last one (it is behind: busy
# streaming), each request's new outputs are merged into the one waiting for it (deltas concatenated),
# so a loop that falls behind gets fewer, larger outputs (several tokens to one SSE event) instead of a
# backlog of callbacks and a per-token cost that grows with it; the engine keeps the device busy. Only
# when a loop has been behind for MAX_BEHIND_S does the engine wait for it, up to AHEAD_WAIT_S a step (a
# wedged loop never stops it): a starved event loop gets the GIL back, and an abort (a client leaving)
# is seen within a bounded time instead of whenever the loop gets to run (issue 27 item 9). Waiting
# after a fixed number of steps instead cost a GPU server at 256 streams a quarter of its throughput
# (the loop is routinely a few 5 ms steps behind there).
MAX_BEHIND_S = 0.2
# A hand-over counts as taken once the loop has run this many iterations after queueing it: the items
# wake each request's generator (the server's pump task), which wakes the response's writer, which
# sends. Counting it taken when merely queued (the loop had not yet written anything) let an engine
# thread whose steps hold the GIL hand over every step: at 256 streams over a zero-cost backend the
# loop sent one SSE event per token (~230 per 256-token request; 25-30 µs of loop each).
SETTLE_ITERATIONS = 3
# Nor does the engine hand over to a loop that has been free for less time than it took over the
# previous hand-over (at most COALESCE_MAX_S): when the two share the GIL they otherwise alternate
# step by step, every step's tokens one SSE event each (top-p sampling releases the GIL inside numpy, so
# the loop kept up: one event a token at 64 and 256 streams, 26 k tok/s). Waiting that long, a stream's
# tokens reach the loop several at a time exactly when the loop costs as much as the engine; a step
# longer than the loop's work (one stream, a GPU forward) hands over at every step as before.
COALESCE_MAX_S = 0.05
# Nor, while steps are short, more often than every HANDOVER_INTERVAL_S: a hand-over costs ~30-50 µs of
# CPU whatever it carries (the loop's wake-up and the GIL passed back and forth, a system call and a
# cross-core wake-up each on this VM: 26 % of the engine thread's time, perf, one stream over a
# zero-cost backend, where the engine hands over every ~20 µs step), so holding a stream's tokens
# for 1 ms keeps that to a few % of the engine's time (0.5 / 1 / 2 ms measured 45 / 37 / 32 µs of server
# CPU per token, greedy). Steps of a real model (a GPU decode step
# takes 1-5 ms, a CPU one more) are longer: every step hands over, as before. Held outputs never wait
# for a step that may be long: anything held goes out before a step that admits requests (new or
# waiting ones: a prefill), and none is held after a step that took more than a quarter of the interval.
# Such a hand-over then waits (at most HANDOVER_WAIT_S) until the loop has run it: the woken loop would
# otherwise wait for the GIL while the engine steps on, and every GIL release of those steps (numpy
# releases it in each argmax) paid a futex wake-up of the waiting loop (perf: pthread_cond_signal, a
# quarter of the engine thread's CPU) without the loop winning the race.
HANDOVER_INTERVAL_S = 0.001
HANDOVER_WAIT_S = 0.001


def steps_are_short(step_s: float, engine: LLMEngine) -> bool:
    """Whether a step that took ``step_s`` lets the next outputs be held (see HANDOVER_INTERVAL_S)."""
    return step_s < HANDOVER_INTERVAL_S / 4 and not engine.scheduler.num_waiting
AHEAD_WAIT_S = 0.05
BURST_QUIET_S = 0.001
BURST_EXPECT_QUIET_S = 0.025
BURST_EXPECT_WITHIN_S = 1.0
BURST_MAX_WAIT_S = 0.1
BURST_EXPECT_MAX_WAIT_S = 0.5


@dataclass(slots=True)
class _Stream:
    """Where one request's outputs go."""

    loop: asyncio.AbstractEventLoop  # the caller's event loop
    queue: asyncio.Queue  # RequestOutput items, or an exception to raise
    error: BaseException | None = None  # an exception that came after outputs, raised once those are out
    box: _Outbox | None = None  # its loop's outbox, once the engine thread has looked it up


@dataclass(slots=True)
class _Outbox:
    """Outputs for one caller event loop not handed over yet; the engine thread's alone."""

    held: dict[str, tuple[asyncio.Queue, RequestOutput]]  # request id -> its queue and its (merged) output
    free: threading.Event  # set once the loop has run the last hand-over (none outstanding)
    sent_at: float = 0.0  # time.monotonic() of the last hand-over
    busy_s: float = 0.0  # how long the loop took over the last hand-over, to its SETTLE_ITERATIONS-th iteration
    freed_at: float = 0.0  # time.monotonic() when it had

    def settled(self, started: float) -> None:
        """On the loop: the hand-over queued at ``started`` (time.monotonic()) has gone through."""
        self.freed_at = time.monotonic()
        self.busy_s = min(self.freed_at - started, COALESCE_MAX_S)
        self.free.set()


@dataclass(slots=True)
class _EmbedJob:
    """One embed() call waiting for the engine thread."""

    token_ids: list[list[int]]  # validated inputs
    loop: asyncio.AbstractEventLoop  # the caller's event loop
    future: asyncio.Future  # resolves to list[EmbeddingOutput], or an exception


class AsyncLLM:
    """``AsyncLLM(model=None, backend=None, config=None, **overrides)``; see LLM for the arguments."""

    def __init__(self, model: str | None = None, backend: str | Backend | None = None,
                 config: CllmConfig | str | Path | None = None, **overrides: Any) -> None:
        self.engine = make_engine(model, backend, config, overrides)
        self.config = self.engine.config
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._embed_jobs: queue.SimpleQueue[_EmbedJob] = queue.SimpleQueue()  # run between steps, batched
        self._wake = threading.Event()
        self._state_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._compiling: dict[str, bool] = {}  # requests whose grammar compiles before they are added: aborted?
        self._pending = 0
        self._num_arriving = 0  # requests between admission checks and the inbox (see _arriving)
        # When requests finished whose clients have not sent another since (oldest first; see BURST_*).
        self._owed: collections.deque[float] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._dead: BaseException | None = None
        self._switching = False  # a backend switch is draining: new requests wait for it
        self._join_timeout_s = 10.0  # how long shutdown waits for a running step
        self._close_lock = threading.Lock()
        self._loop_done = False  # the engine thread has left its loop (under _close_lock)
        self._close_pending = False  # shutdown asked the engine thread to free the engine on exit
        # (stats, running requests) published by the engine thread after every step and command
        # per caller event loop (weakly: short-lived loops come and go), see MAX_BEHIND_S
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = weakref.WeakKeyDictionary()
        # The loops whose outbox holds outputs not handed over yet (a plain dict: iterating the weak one
        # every step cost 5-10 % of a one-stream step).
        self._holding: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._snapshot: tuple[EngineStats, list[RunningRequestInfo]] | None = None
        self._published_at = 0.0  # time.monotonic() of the latest snapshot
        self._steps_short = False  # the last step was short and nothing waits: see HANDOVER_INTERVAL_S

    # ------------------------------------------------------------------ info
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return model_name_of(self.engine)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt, tools,
                                               continue_final_message=continue_final_message)

    def tokenize_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, *, continue_final_message: bool = False) -> list[int]:
        return self.engine.tokenize_chat(messages, add_generation_prompt, tools,
                                         continue_final_message=continue_final_message)

    def expanded_ids(self, prompt: Any) -> list[int]:
        """LLMEngine.expanded_ids; an image's expansion waits for a running step (the backend's tokenizer
        of images is not used from two threads at once)."""
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt)
        with self._state_lock:
            return self.engine.expanded_ids(prompt)

    @property
    def supports_images(self) -> bool:
        return self.engine.supports_images

    def stats(self) -> EngineStats:
        """The engine's stats as of its latest step; never waits for a running step (``/metrics`` and
        ``/v1/engine`` call this from the event loop, which a step-long lock wait would stall)."""
        snapshot = self._snapshot
        if snapshot is not None and self.is_running:
            return snapshot[0]
        with self._state_lock:
            return self.engine.stats()

    def running_requests(self) -> list[RunningRequestInfo]:
        """Running and waiting requests as of the engine's latest step (see ``stats``)."""
        snapshot = self._snapshot
        if snapshot is not None and self.is_running:
            return snapshot[1]
        with self._state_lock:
            return self.engine.running_requests()

    def _publish(self) -> None:
        """Engine thread, under the state lock: the snapshot stats() and running_requests() read."""
        self._snapshot = (self.engine.stats(), self.engine.running_requests())
        self._published_at = time.monotonic()

    def _publish_after_step(self) -> None:
        """After a step: at most every PUBLISH_EVERY_S while busy, always once the engine goes idle."""
        if time.monotonic() - self._published_at >= PUBLISH_EVERY_S or not self.engine.has_unfinished():
            self._publish()

    # ------------------------------------------------------------- the loop
    def start(self) -> None:
        """Start the engine loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cllm-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        _name_os_thread("cllm-engine")
        try:
            while not self._stopping:
                was_idle = not self.engine.has_unfinished()
                taken = self._drain_inbox()
                self._run_embed_jobs()
                if not self.engine.has_unfinished():
                    self._flush_outboxes()
                    if not self._idle_work():  # after a unit of it the inbox is looked at again
                        self._wake.wait(IDLE_WAIT_S)
                        self._wake.clear()
                    continue
                if was_idle:
                    self._gather_burst(taken)
                elif self._holding and (taken or self.engine.scheduler.num_waiting):
                    self._flush_outboxes()  # this step may admit a prefill: nothing held waits for it
                started = time.monotonic()
                with self._state_lock:
                    outputs = self.engine.step()
                    self._publish_after_step()
                self._steps_short = steps_are_short(time.monotonic() - started, self.engine)
                self._owe(sum(1 for out in outputs if out.finished))
                self._deliver_step(outputs)
        except BaseException as err:  # a bug or a fatal backend error: fail every stream loudly
            log.exception("engine loop died")
            self._dead = err
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine stopped: {type(err).__name__}: {err}"))
        finally:
            if self._stopping:  # streams still open missed their abort (it was queued behind a long step)
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError("engine shut down before this request finished"))
            self._fail_embed_jobs(EngineDeadError("engine stopped before the embedding ran"))
            with self._close_lock:
                self._loop_done = True
                if self._close_pending:  # shutdown gave up waiting: free the engine now, after the step
                    self.engine.close()

    def _gather_burst(self, taken: int) -> None:
        """Take in requests still arriving until none is being tokenised and the inbox has been quiet
        for the window of :meth:`_quiet_window`, for at most BURST_MAX_WAIT_S (BURST_EXPECT_MAX_WAIT_S
        when arrivals were owed at the start). ``taken``: requests the idle engine has just drained."""
        self._owe(0)
        expected = bool(self._owed)
        deadline = time.monotonic() + (BURST_EXPECT_MAX_WAIT_S if expected else BURST_MAX_WAIT_S)
        quiet_since = time.monotonic()
        while not self._stopping and (now := time.monotonic()) < deadline:
            window = self._quiet_window(expected, taken)
            self._wake.clear()
            # A burst's wait is the engine's own idle time: spend it on housekeeping the burst's
            # admissions would otherwise do first (saving the idle slots they evict), a unit at a time;
            # never in a lone request's 1 ms window.
            if window >= BURST_EXPECT_QUIET_S and now - quiet_since < window and self._idle_work(gathering=True):
                woke = self._wake.is_set()
            else:
                woke = self._wake.wait(max(0.0, quiet_since + window - now))
            # Read before draining: a request leaves the count only after its command is queued, so
            # one that left it by now is in the inbox. Drained either way: a command queued between
            # the last drain and clear() above had its wake-up cleared.
            arriving = self._num_arriving
            drained = self._drain_inbox()
            taken += drained
            if drained or woke or arriving:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= window:
                return

    def _quiet_window(self, expected: bool, taken: int) -> float:
        """How long the inbox must stay quiet to end a gather: BURST_EXPECT_QUIET_S while arrivals are
        owed, or while an unannounced burst (two or more requests, e.g. N clients starting together)
        is coming in; BURST_QUIET_S for a lone request, and once every owed client is back."""
        if self._owed or (not expected and taken >= 2):
            return BURST_EXPECT_QUIET_S
        return BURST_QUIET_S

    def _idle_work(self, *, gathering: bool = False) -> bool:
        """One unit of the engine's idle housekeeping (saving idle slots' KV to the host prompt cache),
        only once no client is expected back (see BURST_EXPECT_WITHIN_S): a closed-loop client's next
        request must not wait behind it. While a burst is being gathered (``gathering``) the engine
        waits anyway, so the work goes on whoever is owed: in a closed loop of 64 clients on the AVX2
        EPYC the 64 saves at admission (1-15 ms each, mostly page faults) came after the gather and
        put 0.7-2 s in front of the burst's prefill (benchmarks/results/performance_log_llama_cpp.md, "Wave 10")."""
        self._owe(0)
        if self._owed and not gathering:
            return False
        with self._state_lock:
            return self.engine.idle_work(queued_ok=gathering)

    def _owe(self, finished: int) -> None:
        """Note ``finished`` requests whose clients may come back; forget those owed too long."""
        if not finished and not self._owed:
            return
        now = time.monotonic()
        self._owed.extend(itertools.repeat(now, finished))
        while self._owed and self._owed[0] < now - BURST_EXPECT_WITHIN_S:
            self._owed.popleft()

    def _run_embed_jobs(self) -> None:
        """Every queued embed() call, all inputs in one backend.embed (packed per forward): concurrent
        callers are batched with each other. Runs between steps, so it never races a forward pass."""
        if self._embed_jobs.empty():
            return
        jobs = _take_all(self._embed_jobs)
        try:
            with self._state_lock:
                outputs = self.engine.embed_token_ids([ids for job in jobs for ids in job.token_ids])
        except Exception as err:  # a backend failure fails these calls; the engine lives on
            for job in jobs:
                _resolve(job, err)
            return
        start = 0
        for job in jobs:
            _resolve(job, outputs[start:start + len(job.token_ids)])
            start += len(job.token_ids)

    def _fail_embed_jobs(self, err: BaseException) -> None:
        for job in _take_all(self._embed_jobs):
            _resolve(job, err)

    def _drain_inbox(self) -> int:
        """Run every queued command; how many there were. The stats snapshot is republished once per
        drain, not per command (building it walks every request)."""
        if self._inbox.empty():  # (the engine thread is the only reader)
            return 0
        count = 0
        try:
            while True:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return count
                with self._state_lock:
                    command()
                count += 1
                if self._owed:  # a client came back (any command counts: aborts are rare)
                    self._owed.popleft()
        finally:
            if count:
                with self._state_lock:
                    self._publish()

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: merged into what each loop has not been handed yet, then handed over to
        every loop that has run its last hand-over (see MAX_BEHIND_S). One wake-up per loop, not per
        request: each call_soon_threadsafe writes to the loop's self-pipe and takes the GIL back and forth."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            box = stream.box
            if box is None:
                box = stream.box = self._outbox(stream.loop)
            prev = box.held.get(out.request_id)
            box.held[out.request_id] = (stream.queue, out if prev is None else merge_outputs(prev[1], out))
            self._holding[stream.loop] = box
        for loop, box in list(self._holding.items()):
            self._hand_over(loop, box)

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> _Outbox:
        box = self._outboxes.get(loop)
        if box is None:
            box = self._outboxes[loop] = _Outbox({}, threading.Event())
            box.free.set()
        return box

    def _hand_over(self, loop: asyncio.AbstractEventLoop, box: _Outbox, *, force: bool = False) -> None:
        if loop.is_closed() or not box.held:  # (_deliver may have taken the last one)
            box.held.clear()
            self._holding.pop(loop, None)
            return
        if not force and not box.free.is_set():
            if time.monotonic() - box.sent_at < MAX_BEHIND_S or not box.free.wait(AHEAD_WAIT_S):
                return  # still behind: keep merging (one output per request, however many steps)
        elif not force and (time.monotonic() - box.freed_at < box.busy_s
                            or self._steps_short and time.monotonic() - box.sent_at < HANDOVER_INTERVAL_S):
            return  # the loop is free, but not for long enough yet (see COALESCE_MAX_S, HANDOVER_INTERVAL_S): keep merging
        items = list(box.held.values())
        box.held.clear()
        self._holding.pop(loop, None)
        box.free.clear()
        box.sent_at = time.monotonic()
        loop.call_soon_threadsafe(_put_all, items, box)
        if self._steps_short and not force:
            box.free.wait(HANDOVER_WAIT_S)

    def _flush_outboxes(self) -> None:
        """Hand over everything held (the engine is going idle: no later step would)."""
        for loop, box in list(self._holding.items()):
            self._hand_over(loop, box, force=True)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """One item for one request (an error, an abort's final output), after whatever of its output is
        still held, in one callback: callbacks run in order, so the request's outputs stay in order."""
        stream = self._streams.get(request_id)
        if stream is None or stream.loop.is_closed():
            return
        items = []
        box = self._outboxes.get(stream.loop)
        if box is not None and request_id in box.held:
            items.append(box.held.pop(request_id))
        items.append((stream.queue, item))
        stream.loop.call_soon_threadsafe(_put_all, items, None)

    # ------------------------------------------------------------- requests
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, timeout_s: float | None = None,
                       on_queued: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; each carries the deltas since the previous one.

        ``on_queued`` is called on the caller's event loop once the engine has accepted the request
        (after that only the request's own end can fail it), e.g. to send a stream's headers."""
        params = params or SamplingParams()
        while self._switching:  # a backend switch is draining; this request goes to the new engine
            await asyncio.sleep(0.01)
        rid = self._admit_checks(prompt, params, request_id)
        aborted: RequestOutput | None = None
        with self._arriving():
            ids = await prompt_token_ids(self.engine.tokenize_prompt, prompt)
            self.engine.resolve_max_tokens(len(ids), params)
            self.engine.check_params(params)  # stop strings, constraint size: before anything is registered
            if params.constraint_key is not None:
                # A cold grammar compile takes milliseconds to seconds: off the event loop and the engine
                # loop, so the engine only ever meets cached grammars.
                if await self._compile(rid, params):
                    aborted = aborted_before_start(rid, prompt if isinstance(prompt, str) else None, ids, params.n)
            if aborted is None:
                stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
                self._streams[rid] = stream
                self._pending += params.n
                self.start()
                self._submit(lambda: self._add(rid, prompt, params, priority, timeout_s, ids, on_queued))
        if aborted is not None:  # abort() came while its grammar compiled: it ends as an aborted request does
            yield aborted
            return
        async with contextlib.aclosing(self._consume(rid, stream)) as outputs:  # closing us aborts at once
            async for out in outputs:
                yield out

    async def _consume(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; abort it if the caller stops early."""
        finished = False
        try:
            while not finished:
                try:
                    out = await self._next_output(stream)
                except RequestHandedOffError:
                    finished = True  # the engine let it go already: nothing to abort
                    raise
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._submit(lambda: self._abort_now(rid))
            self._streams.pop(rid, None)

    async def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, *,
                   add_generation_prompt: bool = True, tools: list[dict] | None = None, tool_choice: Any = None,
                   parallel_tool_calls: bool | None = None, response_format: Any = None,
                   **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """``generate`` for a conversation; the chat template renders and tokenises in a thread, so a
        long conversation does not stall the caller's event loop (issue 9 defect 17).

        ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` / ``response_format`` as in LLM.chat; the
        final output carries the parsed ``tool_calls`` (finish_reason "tool_calls")."""
        with self._arriving():
            request = await asyncio.to_thread(
                prepare_chat, self.engine, messages, params, tools=tools, tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                add_generation_prompt=add_generation_prompt)
        async with contextlib.aclosing(self.generate(request.prompt_ids, request.params, **kwargs)) as outputs:
            async for out in outputs:
                yield attach_tool_calls(out, request.plan) if out.finished else out
    async def embed(self, inputs: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """Embeddings of texts (or token-id lists), in input order (see LLM.embed). Calls made while
        others wait are run together, packed several inputs per forward pass."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        if items and all(isinstance(t, int) for t in items):
            items = [items]  # one token-id input
        token_ids = await asyncio.to_thread(self.engine.embedding_token_ids, items)
        loop = asyncio.get_running_loop()
        job = _EmbedJob(token_ids, loop, loop.create_future())
        self.start()
        self._embed_jobs.put(job)
        self._wake.set()
        if self._loop_done or self._dead is not None:  # the loop ended before it could see the job
            self._fail_embed_jobs(EngineDeadError("engine stopped before the embedding ran"))
        return await job.future

    @contextlib.contextmanager
    def _arriving(self) -> Iterator[None]:
        """Counts a request while it is tokenised or templated, before it reaches the inbox: an idle
        engine gathering a burst waits for it (see _gather_burst)."""
        self._num_arriving += 1
        try:
            yield
        finally:
            self._num_arriving -= 1

    def _admit_checks(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> str:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._streams or rid in self._compiling:
            raise ValueError(f"request_id {rid!r} is already in use")
        limit = self.config.scheduler.max_waiting
        if self.engine.scheduler.num_waiting + self._pending + params.n > limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")
        return rid

    def _add(self, rid: str, prompt: Prompt, params: SamplingParams, priority: int, timeout_s: float | None,
             ids: list[int], on_queued: Callable[[], None] | None) -> None:
        self._pending -= params.n
        stream = self._streams.get(rid)
        if stream is None:
            return  # the caller gave up before the loop saw the request
        try:
            self.engine.add_request(prompt, params, request_id=rid, priority=priority, timeout_s=timeout_s, prompt_ids=ids)
        except (ValueError, QueueFullError) as err:
            self._deliver(rid, err)
            return
        if on_queued is not None and not stream.loop.is_closed():
            stream.loop.call_soon_threadsafe(on_queued)

    def _abort_now(self, rid: str) -> None:
        out = self.engine.abort_request(rid)
        if out is not None:
            self._deliver(rid, out)

    @staticmethod
    async def _next_output(stream: _Stream) -> RequestOutput:
        return await next_merged_output(stream)

    # ------------------------------------------------------------- hand-off
    async def export_request(self, request_id: str) -> tuple[RequestSnapshot, list[bytes]]:
        """Take a live n=1 request out between two steps, for another engine to continue
        (``resume``): its snapshot and KV segments. Its stream here ends with RequestHandedOffError."""
        def command() -> tuple[RequestSnapshot, list[bytes]]:
            result = self.engine.export_request(request_id)
            self._deliver(request_id, RequestHandedOffError(f"request {request_id!r} moved to another engine"))
            return result
        return await self._call(command)

    async def resume(self, snapshot: RequestSnapshot, segments: list[bytes]) -> AsyncIterator[RequestOutput]:
        """Continue a request another engine exported; streams its outputs from where it stopped.

        A constrained request's grammar compiles off the engine thread first (as in ``generate``), so
        the import meets a cached one. A caller that goes away (cancelled, closed) once the import is
        queued leaves an abort queued right behind it: the imported request never runs on alone."""
        rid = self._admit_checks(snapshot.prompt_token_ids, snapshot.params, snapshot.request_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        queued = False
        try:
            if snapshot.params.constraint_key is not None:
                await asyncio.to_thread(self.engine.structured.compile, snapshot.params)
            queued = True
            await self._call(lambda: self.engine.import_request(snapshot, segments))
        except BaseException as err:
            self._streams.pop(rid, None)
            if queued and not isinstance(err, Exception):  # the inbox runs commands in order: after the import
                self._submit(lambda: self._abort_now(rid))
            raise
        async with contextlib.aclosing(self._consume(rid, stream)) as outputs:  # closing us aborts at once
            async for out in outputs:
                yield out

    def live_request_ids(self) -> list[str]:
        """Requests the engine holds now (a draining replica hands these over)."""
        return self.engine.request_ids()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps; its result or exception comes back here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        def command() -> None:
            try:
                result = fn()
            except Exception as err:  # delivered to the caller, the loop carries on
                loop.call_soon_threadsafe(settle, None, err)
                return
            loop.call_soon_threadsafe(settle, result, None)
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        self.start()
        self._submit(command)
        return await future

    async def abort(self, request_id: str) -> None:
        if request_id in self._compiling:  # not in the engine yet: generate ends it once the compile returns
            self._compiling[request_id] = True
        self._submit(lambda: self._abort_now(request_id))

    async def _compile(self, rid: str, params: SamplingParams) -> bool:
        """Compile a request's grammar in a thread; True if the request was aborted meanwhile."""
        self._compiling[rid] = False
        try:
            await asyncio.to_thread(self.engine.structured.compile, params)
        finally:
            aborted = self._compiling.pop(rid)
        return aborted

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to ``grace_s``; abort the rest; free everything."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.engine.has_unfinished() and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._submit(self._abort_all)
        await asyncio.to_thread(self._stop_thread)
        with self._close_lock:
            if self._thread is not None and not self._loop_done:
                # A step is still running inside llama.cpp/torch: freeing the backend now would be a
                # use-after-free. The engine thread frees it when the step returns.
                log.warning("engine step still running after %.0f s; it frees the backend when it ends",
                            self._join_timeout_s)
                self._close_pending = True
                return
        self.engine.close()

    async def switch_backend(self, backend: str, **overrides: Any) -> None:
        """Move to another backend without restarting: the new one loads in a thread while the old one
        serves; then in-flight requests finish on the old engine (drain), requests that arrive
        meanwhile wait, and the engines are swapped between two steps. If loading fails the error is
        raised and the old backend keeps serving."""
        config = self.config.with_overrides(backend=backend, **overrides)
        new = await asyncio.to_thread(LLMEngine, config)
        self._switching = True
        try:
            while self.engine.has_unfinished() or self._pending:
                await asyncio.sleep(0.01)
            swapped = threading.Event()

            def swap() -> None:
                old, self.engine, self.config = self.engine, new, config
                old.close()
                swapped.set()
            if self.is_running:
                self._submit(swap)
                await asyncio.to_thread(swapped.wait)
            else:
                with self._state_lock:
                    swap()
            freeze_live_objects()  # what the old engine left in reference cycles becomes collectable
        finally:
            self._switching = False

    def _abort_all(self) -> None:
        for rid in self.engine.request_ids():
            self._abort_now(rid)

    def _stop_thread(self) -> None:
        """Let the loop run the queued aborts, then end it."""
        if self._thread is None:
            return
        deadline = time.monotonic() + 5
        while (self.engine.has_unfinished() or not self._inbox.empty()) and self.is_running and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=self._join_timeout_s)


def model_name_of(engine: LLMEngine) -> str:
    """The served model's default name: the weights file's stem, or the model directory's name."""
    path = getattr(engine.backend, "model_path", None) or resolve_model_path(engine.config.model.model)
    return Path(path).stem if Path(path).suffix == ".gguf" else Path(path).name


async def next_merged_output(stream: Any) -> RequestOutput:
    """A stream's next output, merged with any others already queued (deltas concatenated); raises the
    exception queued for it once the outputs before it are out. ``stream``: its ``queue`` of outputs
    and exceptions, and ``error``, the exception held back meanwhile."""
    if stream.error is not None:
        raise stream.error
    item = await stream.queue.get()
    items = [item]
    while not stream.queue.empty() and not isinstance(items[-1], BaseException):
        items.append(stream.queue.get_nowait())
    if isinstance(items[-1], BaseException):
        if len(items) == 1:
            raise items[0]
        stream.error = items.pop()  # outputs that came first are handed out first (a hand-off's last tokens)
    return _merge(items)


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name at the OS level too (top -H, py-spy, /proc/PID/task/*/comm), so
    the engine thread's CPU can be told from the event loop's; a no-op off Linux."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]], box: _Outbox | None) -> None:
    """On the caller's loop: queue a hand-over's items, then tell the engine thread, once the loop has
    run SETTLE_ITERATIONS more times, that it was taken and how long that took (see COALESCE_MAX_S)."""
    started = time.monotonic()
    try:
        for queue_, item in items:
            queue_.put_nowait(item)
    finally:
        if box is not None:
            after_iterations(asyncio.get_running_loop(), SETTLE_ITERATIONS, functools.partial(box.settled, started))


def after_iterations(loop: asyncio.AbstractEventLoop, n: int, callback: Callable[[], None]) -> None:
    """Run ``callback`` after ``n`` more iterations of ``loop`` (each call_soon runs in the next one, after
    the callbacks already scheduled, such as the task wake-ups the items above caused)."""
    if n <= 0:
        callback()
    else:
        loop.call_soon(after_iterations, loop, n - 1, callback)


def _take_all(jobs: queue.SimpleQueue[_EmbedJob]) -> list[_EmbedJob]:
    taken = []
    while True:
        try:
            taken.append(jobs.get_nowait())
        except queue.Empty:
            return taken


def _resolve(job: _EmbedJob, result: list[EmbeddingOutput] | BaseException) -> None:
    """Hand a result to the caller's loop (a caller that gave up has a cancelled future: skip it)."""
    def settle() -> None:
        if job.future.done():
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)
    if not job.loop.is_closed():
        job.loop.call_soon_threadsafe(settle)


def _merge(items: list[RequestOutput]) -> RequestOutput:
    merged = items[0]
    for item in items[1:]:
        merged = merge_outputs(merged, item)
    return merged
