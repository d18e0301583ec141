"""ProcessEngine: the engine core in a process of its own, with the AsyncLLM surface the server uses.

The API process (uvicorn's event loop) validates and tokenises requests here, sends them to the core
(engine_core.py) over a pipe, and streams back each step's outputs, which arrive as one message per
step and are read on the event loop (``add_reader``: no thread of ours competes with it). Two GILs:
the engine never waits for the event loop to hand the interpreter back, and the loop's streaming and
the engine's Python run on two cores at once (why: engine_core.py).

Guarantees kept from the in-process engine: bad input fails before anything is queued; the waiting
queue's bound (HTTP 429) counts requests on their way to the core; a caller that stops iterating
aborts its request; a loop that falls behind gets several tokens merged into one output (its queue
is merged on read, as AsyncLLM's); the core stops stepping while more than a bounded number of its
messages are unread; an engine that dies (or a core process that exits) fails every stream with
EngineDeadError and turns ``is_running`` false (``/health`` says 503).

A core that dies is restarted by this process (a supervisor): the requests it held fail (their
streams end with EngineDeadError, HTTP 503 / an error event), new requests get 503 while the new core
loads, and then the server serves again. Restarts are bounded (RestartPolicy: at most
``max_restarts`` within ``window_s``, waiting ``backoff_s`` doubled each time): past the bound the
engine stays stopped and ``/health`` says 503, for a process supervisor (systemd, Kubernetes) to act.

``server.engine_process``: on, off, or auto (on for the torch backend on CUDA, where steps are a few
milliseconds; off for llama.cpp and CPU backends, whose steps are long enough that the in-process
thread costs nothing and one process holds the model once).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from cllm.backends.base import Backend, Tokenizer
from cllm.config import CllmConfig
from cllm.engine.async_llm import COALESCE_MAX_S, SETTLE_ITERATIONS, after_iterations, next_merged_output
from cllm.engine.prompt_ids import prompt_token_ids
from cllm.multimodal.prompt import ids_without_images
from cllm.engine.core_protocol import (
    AbortRequest, AddRequest, Admitted, CoreFailed, CoreReady, CoreStopped, EmbedDone, EmbedRequest, Snapshot,
    FrameReader, Settled, StepOutputs, StopCore, decode, encode, is_delta, unpack_delta, unpack_output,
)
from cllm.engine.engine_core import CoreSpec, run_engine_core
from cllm.engine.pipe_writer import LoopPipeWriter
from cllm.engine.llm_engine import LLMEngine, Prompt
from cllm.engine.stats import EngineStats, RunningRequestInfo
from cllm.errors import EngineDeadError, QueueFullError
from cllm.gc_freeze import raise_gc_threshold
from cllm.outputs import EmbeddingOutput, RequestOutput, aborted_before_start
from cllm.sampling.params import SamplingParams
from cllm.server.client_quota import payer_client
from cllm.structured.limits import current_payer

log = logging.getLogger("cllm.engine")
MAX_MESSAGES_PER_WAKE = 64  # messages read per event-loop wake-up, so reading never starves the loop's other work
JOIN_TIMEOUT_S = 10.0  # how long shutdown waits for the core to exit before killing it
EXIT_WAIT_S = 2.0  # how long a core whose pipe closed may take to exit before it is killed (its exit code read)


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    """How the API process restarts a core that died: at most ``max_restarts`` within ``window_s``,
    the k-th recent one after ``backoff_s * 2**k`` seconds; past that the engine stays stopped."""

    max_restarts: int = 3  # restarts (tries included) within the window; 0 = never restart
    window_s: float = 600.0  # how far back restarts count
    backoff_s: float = 1.0  # wait before the first restart of a window (doubled for each later one)


def wants_engine_process(config: CllmConfig) -> bool:
    """``server.engine_process`` resolved: auto is on for the torch backend on CUDA."""
    choice = config.server.engine_process
    if choice != "auto":
        return choice == "on"
    if config.model.backend != "torch":
        return False
    device = config.torch.device
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


class EngineProcessUnavailable(RuntimeError):
    """The engine loaded in its process but cannot be served from there (its tokenizer did not pickle);
    it freed everything and exited: the engine can be built in-process instead."""


@dataclass(slots=True)
class _Stream:
    """One request: where its outputs go (read by next_merged_output), and what its outputs get back
    (pack_output leaves them out)."""

    queue: asyncio.Queue  # RequestOutput items, or an exception to raise
    on_queued: Callable[[], None] | None  # called once the core queued the request
    prompt: Prompt  # as given
    prompt_ids: list[int]  # tokenised
    prompt_logprobs: list | None = None  # sent once by the core, put back on every later output
    error: BaseException | None = None  # an exception that came after outputs, raised once those are out
    sink: Callable[[RequestOutput | BaseException], None] | None = None  # open_stream's: takes the items instead of queue
    last: RequestOutput | None = None  # the latest output (a plain delta is unpacked against it)


class ProcessEngine:
    """``ProcessEngine(config, backend_factory=None)``: starts the core process and waits until its
    engine is loaded (call it off the event loop, as the server's loader does)."""

    in_own_process = True  # for the server's ready lines

    # The prompt checks of the in-process engine, reused as they are: they need only ``tokenizer``,
    # ``config``, ``max_model_len`` and a ``_chat`` slot, which this class has.
    tokenize_prompt = LLMEngine.tokenize_prompt
    check_images = LLMEngine.check_images
    expanded_ids = staticmethod(ids_without_images)
    check_params = LLMEngine.check_params
    tokenize_chat = LLMEngine.tokenize_chat
    apply_chat_template = LLMEngine.apply_chat_template
    resolve_max_tokens = LLMEngine.resolve_max_tokens

    def __init__(self, config: CllmConfig, backend_factory: Callable[[], Backend] | None = None, *,
                 restart: RestartPolicy = RestartPolicy(), join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.config = config
        self._chat = None
        self._backend_factory = backend_factory
        raise_gc_threshold()  # as LLMEngine does: this process's requests and outputs churn objects as a step does
        self.restart_policy = restart
        self._join_timeout_s = join_timeout_s
        self._process, self._outputs, self._commands, ready = _spawn_core(config, backend_factory, join_timeout_s)
        self.tokenizer: Tokenizer = ready.tokenizer if ready.tokenizer is not None else _load_tokenizer(config)
        self.max_model_len = ready.max_model_len
        self.model_name = ready.model_name
        self.device_text = ready.device_text
        self.determinism = ready.determinism
        self.device_memory_bytes = ready.device_memory_bytes  # what the core's load took on the GPU (router)
        self.device_total_bytes = ready.device_total_bytes
        self.max_num_seqs = ready.max_num_seqs
        self.supports_images = ready.supports_images
        self.core_realtime = ready.realtime  # its loop thread at real-time priority (for the ready lines)
        self._snapshot: Snapshot = ready.snapshot
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # sequences sent to the core whose Admitted has not come back
        self._embeds: dict[int, asyncio.Future] = {}
        self._job_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: FrameReader | None = None  # the core's messages, once start() bound us to a loop
        self._accepting = True
        self._dead: EngineDeadError | None = None  # why no request can run now (the core died; maybe restarting)
        self._stopped = False  # the core said CoreStopped (or its pipe closed)
        self._restarts: collections.deque[float] = collections.deque()  # when recent restarts began
        self._restart_task: asyncio.Task | None = None
        self.num_restarts = 0  # cores started after the first (for /v1/engine and the tests)

    # ------------------------------------------------------------------ info
    @property
    def core_pid(self) -> int | None:
        """The engine core's process id (what it holds in memory is measured there: cllm/router/memory.py)."""
        return self._process.pid

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopped and self._process.is_alive()

    @property
    def restarting(self) -> bool:
        """A new core is being started after one died."""
        return self._restart_task is not None and not self._restart_task.done()

    @property
    def failure(self) -> str | None:
        """Why no request can run now (the core died, maybe restarting), or None."""
        return None if self._dead is None else str(self._dead)

    def stats(self) -> EngineStats:
        """The engine's stats as of the latest snapshot the core sent (at most PUBLISH_EVERY_S old while busy)."""
        return self._snapshot[0]

    def running_requests(self) -> list[RunningRequestInfo]:
        return self._snapshot[1]

    def start(self) -> None:
        """Read the core's messages on the calling event loop (idempotent; one loop per engine)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._reader = FrameReader(self._outputs.fileno())
            loop.add_reader(self._outputs.fileno(), self._on_readable)
        elif self._loop is not loop:
            raise RuntimeError("a ProcessEngine serves the one event loop that started it")

    # ------------------------------------------------------------- requests
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, timeout_s: float | None = None,
                       on_queued: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (deltas), as AsyncLLM.generate."""
        rid, stream = await self._add(prompt, params, request_id, priority, timeout_s, on_queued, None)
        async with contextlib.aclosing(self._consume(rid, stream)) as outputs:  # closing us aborts at once
            async for out in outputs:
                yield out

    async def open_stream(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                          priority: int = 0, timeout_s: float | None = None, on_queued: Callable[[], None] | None = None,
                          sink: Callable[[RequestOutput | BaseException], None]) -> Callable[[], None]:
        """:meth:`generate` without a task or a queue per request: the event loop's reader hands each output
        to ``sink`` as it arrives, and the request ends with a finished output or an exception (the last
        call). Returns ``close``, which aborts the request if it has not ended (idempotent). Refusals
        (a full queue, a bad prompt) raise here, as generate's first step does. ``sink`` must not raise.
        At 256 streams the server's pump task per request (a queue, its task's wake-up, two generator
        frames per output) took ~9 % of the event loop (py-spy, engine_overhead.py)."""
        rid, stream = await self._add(prompt, params, request_id, priority, timeout_s, on_queued, sink)

        def close() -> None:
            if self._streams.get(rid) is stream:  # not ended: nothing reached the sink's last call
                self._streams.pop(rid)
                if self.is_running:
                    self._commands.send(AbortRequest(rid))
        return close

    async def _add(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, priority: int,
                   timeout_s: float | None, on_queued: Callable[[], None] | None,
                   sink: Callable[[RequestOutput | BaseException], None] | None) -> tuple[str, _Stream]:
        """Check, tokenise, register and send one request to the core."""
        params = params or SamplingParams()
        rid = self._admit_checks(params, request_id)
        self.start()
        # Everything the core would refuse is refused here, before anything is registered: a request
        # the core cannot take must never hold a stream or a place in max_waiting.
        self.check_params(params)
        ids = await prompt_token_ids(self.tokenize_prompt, prompt)
        self.resolve_max_tokens(len(ids), params)
        self._admit_checks(params, rid)  # the core may have died, or the id been taken, meanwhile
        if type(prompt) is list and prompt == ids:
            prompt = ids  # one list, pickled once (a 150-id prompt twice was ~40 % of the add's decoding in the core)
        message = _encode_add(AddRequest(rid, prompt, params, priority, timeout_s, ids, payer_client(current_payer())))
        stream = _Stream(asyncio.Queue(), on_queued, prompt, ids, sink=sink)
        self._streams[rid] = stream
        self._pending += params.n
        sent = False
        try:
            self._commands.send_encoded(message)
            sent = True
        finally:
            if not sent:  # nothing reached the core: nothing will answer for these
                self._streams.pop(rid, None)
                self._pending -= params.n
        return rid, stream

    def _deliver(self, rid: str, stream: _Stream, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the request's queue (generate) or sink (open_stream; its last item unregisters it)."""
        if stream.sink is None:
            stream.queue.put_nowait(item)
            return
        if isinstance(item, BaseException) or item.finished:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
        try:
            stream.sink(item)
        except Exception:  # a sink's bug must not stop the other streams' outputs in this frame
            log.exception("the output sink of request %s failed", rid)

    async def _consume(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await next_merged_output(stream)
                finished = out.finished
                yield out
        finally:
            if not finished and self.is_running:
                self._commands.send(AbortRequest(rid))
            self._streams.pop(rid, None)

    def _admit_checks(self, params: SamplingParams, request_id: str | None) -> str:
        self._check_alive()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        limit = self.config.scheduler.max_waiting
        if self._snapshot[0].num_waiting + self._pending + params.n > limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")
        return rid

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._accepting or self._stopped:
            raise EngineDeadError("server is shutting down")

    async def abort(self, request_id: str) -> None:
        if self.is_running:
            self._commands.send(AbortRequest(request_id))

    async def embed(self, inputs: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """Embeddings in input order (see AsyncLLM.embed); the core validates the inputs and batches
        concurrent calls into one backend pass."""
        self._check_alive()
        self.start()
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        if items and all(isinstance(t, int) for t in items):
            items = [items]  # one token-id input
        job_id = next(self._job_ids)
        future = asyncio.get_running_loop().create_future()
        self._embeds[job_id] = future
        try:
            self._commands.send(EmbedRequest(job_id, items))
            return await future
        finally:
            self._embeds.pop(job_id, None)

    # ------------------------------------------------------------- messages
    def _on_readable(self) -> None:
        """Event loop: take what the core sent (a bounded number of messages; the rest on the next wake-up)."""
        try:
            frames = self._reader.read(MAX_MESSAGES_PER_WAKE)
        except OSError as err:
            frames = []
            log.error("reading from the engine process failed: %s", err)
            self._reader.at_eof = True
        for frame in frames:
            self._handle(decode(frame))
        if self._reader.has_frame() and self._loop is not None and not self._stopped:
            self._loop.call_soon(self._on_readable)  # the rest of what was read, after the loop's other work
            return
        if self._reader.at_eof and not self._stopped:  # the core exited without a word: it died, unless shut down
            self._core_gone(f"the engine process {self._exit_text()}" if self._accepting else None)

    def _exit_text(self) -> str:
        """How the core's process ended ("exited with code 1", "was killed by SIGKILL"): its pipe closed,
        so it is exiting; waited for briefly (a real exit code, not None), killed if it lingers."""
        self._process.join(EXIT_WAIT_S)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join(EXIT_WAIT_S)
            return "closed its pipe and was killed"
        return _exit_words(self._process.exitcode)

    def _handle(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            for packed in message.outputs:
                stream = self._streams.get(packed[0])
                if stream is not None:
                    self._deliver(packed[0], stream, self._unpack(packed, stream))
            if message.snapshot is not None:
                self._snapshot = message.snapshot
            if message.settle:  # settled once the streams' tasks have run it through (see engine_core.MAX_UNSETTLED)
                self._settle_later(self._commands)  # to the core that sent it (not to one restarted meanwhile)
        elif isinstance(message, Admitted):
            self._admitted(message)
        elif isinstance(message, EmbedDone):
            self._embedded(message)
        elif isinstance(message, CoreStopped):
            self._core_gone(message.error)

    def _settle_later(self, commands: LoopPipeWriter) -> None:
        """Settle a StepOutputs once the loop has run it through (SETTLE_ITERATIONS: the streams' tasks
        have written it), and then once the loop has been free for as long as that took (at most
        COALESCE_MAX_S), as AsyncLLM hands over to a loop no sooner: the core merges each request's tokens
        meanwhile, so streaming takes at most about half of a busy loop and the rest is left to admitting
        requests. Settling at the third iteration kept the loop ~100 % busy with SSE writes at 256 streams
        (a quarter of its time in the socket writes alone), and each new request queued behind them; the
        delay cut the loop's CPU per token 19.9 -> 17.1 µs and the clients' 5.6 -> 4.3 (six alternating
        runs, benchmarks/engine_overhead.py --device-ms 5). A light load pays nothing: one stream's output
        takes the loop microseconds, so its Settled goes microseconds later."""
        started = time.monotonic()
        after_iterations(self._loop, SETTLE_ITERATIONS, lambda: self._loop.call_later(
            min(time.monotonic() - started, COALESCE_MAX_S), self._settled, commands))

    def _settled(self, commands: LoopPipeWriter) -> None:
        if not self._stopped and commands is self._commands:
            commands.send(Settled())

    @staticmethod
    def _unpack(packed: tuple, stream: _Stream) -> RequestOutput:
        if is_delta(packed):  # (the core sends one only after a full output of the request)
            out = unpack_delta(packed, stream.last)
        else:
            out = unpack_output(packed, stream.prompt, stream.prompt_ids)
            if out.prompt_logprobs is not None:
                stream.prompt_logprobs = out.prompt_logprobs
            else:
                out.prompt_logprobs = stream.prompt_logprobs
        stream.last = out
        return out

    def _admitted(self, message: Admitted) -> None:
        self._pending -= message.num_sequences
        stream = self._streams.get(message.request_id)
        if stream is None:
            return  # the caller gave up before the core queued it (its abort follows the add)
        if message.error is not None:
            self._deliver(message.request_id, stream, message.error)
        elif message.aborted:  # aborted while its grammar compiled: it ends as an aborted request does
            prompt = stream.prompt if isinstance(stream.prompt, str) else None
            self._deliver(message.request_id, stream, aborted_before_start(message.request_id, prompt,
                                                                          stream.prompt_ids, message.num_sequences))
        elif stream.on_queued is not None:
            stream.on_queued()

    def _embedded(self, message: EmbedDone) -> None:
        future = self._embeds.get(message.job_id)
        if future is None or future.done():
            return  # the caller gave up
        if isinstance(message.result, BaseException):
            future.set_exception(message.result)
        else:
            future.set_result(message.result)

    def _core_gone(self, error: str | None) -> None:
        """The core ended: a fatal error (every stream fails with it; a restart may follow) or the end
        of a shutdown. Nothing of the dead core stays: its requests' streams, its embed calls, the
        places counted for its adds, its stats snapshot (no phantom running requests)."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is not None:
            self._loop.remove_reader(self._outputs.fileno())
        if error is not None:  # not the end of a shutdown we asked for: the engine died
            self._dead = EngineDeadError(f"engine stopped: {error}")
            log.error("engine process stopped: %s", error)
        failure = self._dead or EngineDeadError("engine shut down before this request finished")
        for rid, stream in list(self._streams.items()):
            self._deliver(rid, stream, failure)
        for future in self._embeds.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"{failure}: the embedding did not run"))
        self._pending = 0
        self._snapshot = _idle_snapshot(self._snapshot)
        if error is not None and self._accepting:
            self._maybe_restart()

    # ------------------------------------------------------------- restarts
    def _maybe_restart(self) -> None:
        """Start a new core after ``backoff``, unless the policy's restarts in its window are used up."""
        policy = self.restart_policy
        now = time.monotonic()
        while self._restarts and self._restarts[0] < now - policy.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= policy.max_restarts or self._loop is None:
            if policy.max_restarts:
                log.error("the engine core died %d times within %.0f s: not restarting it; the server stays "
                          "unhealthy (/health 503) until it is restarted", len(self._restarts) + 1, policy.window_s)
            return
        delay = policy.backoff_s * 2 ** len(self._restarts)
        self._restarts.append(now)
        self._dead = EngineDeadError(f"{self._dead}; restarting the engine (in {delay:g} s)")
        log.warning("restarting the engine core in %g s (restart %d of at most %d within %.0f s)", delay,
                    len(self._restarts), policy.max_restarts, policy.window_s)
        self._restart_task = self._loop.create_task(self._restart(delay))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self._accepting:
            return
        try:
            process, outputs, commands, ready = await asyncio.to_thread(
                _spawn_core, self.config, self._backend_factory, self._join_timeout_s)
        except Exception as err:  # a load that fails counts as a restart; the policy decides on another
            log.error("restarting the engine core failed: %s", err)
            self._dead = EngineDeadError(f"engine stopped: restarting it failed: {err}")
            self._maybe_restart()
            return
        self._commands.close(timeout_s=1.0)
        self._outputs.close()
        self._process, self._outputs, self._commands = process, outputs, commands
        self._snapshot = ready.snapshot
        self.core_realtime = ready.realtime
        self._reader = FrameReader(outputs.fileno())
        self._loop.add_reader(outputs.fileno(), self._on_readable)
        self._stopped = False
        self._dead = None
        self.num_restarts += 1
        log.warning("the engine core was restarted (pid %d)", process.pid)

    # ------------------------------------------------------------- shutdown
    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to ``grace_s``; then the core aborts the
        rest, frees the engine and exits (killed if it has not after JOIN_TIMEOUT_S)."""
        self._accepting = False
        if self._restart_task is not None:  # a new core loading: it is stopped as any other
            with contextlib.suppress(Exception):
                await self._restart_task
        deadline = time.monotonic() + grace_s
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._process.is_alive():
            self._commands.send(StopCore())
        await asyncio.to_thread(self._process.join, self._join_timeout_s)
        if self._process.is_alive():
            log.warning("the engine process did not exit %.0f s after being asked to; killing it", self._join_timeout_s)
            self._process.kill()
            await asyncio.to_thread(self._process.join, JOIN_TIMEOUT_S)
        deadline = time.monotonic() + 2.0
        while self._loop is not None and not self._stopped and time.monotonic() < deadline:
            self._on_readable()  # the aborted requests' final outputs, then CoreStopped (or the pipe's end)
            await asyncio.sleep(0.005)
        self._core_gone(None)
        self._commands.close(timeout_s=1.0)
        self._outputs.close()


def _spawn_core(config: CllmConfig, backend_factory: Callable[[], Backend] | None,
                join_timeout_s: float) -> tuple[Any, Connection, LoopPipeWriter, CoreReady]:
    """Start a core process and wait until its engine is loaded (blocking): its process, the end its
    outputs come from, the sender of its commands, its CoreReady. A load failure raises."""
    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    commands_out, commands_in = context.Pipe(duplex=False)
    outputs_out, outputs_in = context.Pipe(duplex=False)
    process = context.Process(target=run_engine_core, name="cllm-engine-core", daemon=True,
                              args=(CoreSpec(config, backend_factory), commands_out, outputs_in))
    process.start()
    commands_out.close()  # the child's ends
    outputs_in.close()
    commands = LoopPipeWriter(commands_in)
    try:
        ready = _wait_ready(process, outputs_out, join_timeout_s)
    except BaseException:
        commands.close(timeout_s=1.0)
        outputs_out.close()
        raise
    return process, outputs_out, commands, ready


def _wait_ready(process: Any, outputs: Connection, join_timeout_s: float) -> CoreReady:
    """The core's first message; a load failure (or a core that exits while loading) raises."""
    try:
        while not outputs.poll(0.5):
            if not process.is_alive():
                raise EOFError
        message = decode(outputs.recv_bytes())
    except EOFError:
        process.join(join_timeout_s)
        raise RuntimeError(f"the engine process {_exit_words(process.exitcode)} while loading the model") from None
    if isinstance(message, CoreFailed):
        process.join(join_timeout_s)
        if message.in_thread_ok:
            raise EngineProcessUnavailable(f"the engine cannot run in its own process: {message.error}")
        raise RuntimeError(f"the engine process could not load the model: {message.error}")
    return message


def _exit_words(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _encode_add(message: AddRequest) -> bytes:
    """The AddRequest pickled, or a ValueError (HTTP 400) naming the field that cannot be sent to the core
    (nested past the interpreter's stack, an object pickle refuses)."""
    try:
        return encode(message)
    except Exception as err:  # RecursionError, PicklingError, TypeError …: this request's content
        field = next((name for name in ("prompt", *SAMPLING_FIELDS) if _unpicklable(message, name)), "request")
        raise ValueError(f"invalid {field}=<cannot be sent to the engine process: {type(err).__name__}>: the "
                         f"request holds a value nested too deeply or of an unsupported kind; simplify it") from None


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _unpicklable(message: AddRequest, name: str) -> bool:
    value = message.prompt if name == "prompt" else getattr(message.params, name)
    try:
        encode(value)
    except Exception:
        return True
    return False


def _idle_snapshot(snapshot: Snapshot) -> Snapshot:
    """A dead core's stats with nothing live in them (its counters kept): no request runs, waits or
    holds a slot once the core is gone."""
    stats = dataclasses.replace(snapshot[0], num_running=0, num_waiting=0, num_preempted=0, slots_in_use=0,
                                kv_usage=0.0, tokens_per_s=0.0)
    return stats, []


def _load_tokenizer(config: CllmConfig) -> Tokenizer:
    """The vocabulary alone, for llama.cpp's tokenizer (a native handle, not sent over by the core)."""
    if config.model.backend != "llama_cpp":
        raise RuntimeError(f"the {config.model.backend!r} backend's tokenizer cannot be sent to the API process")
    from cllm.backends.llama_cpp.native import LlamaModelHandle
    from cllm.backends.llama_cpp.tokenizer import LlamaCppTokenizer
    from cllm.model_path import resolve_model_path

    return LlamaCppTokenizer(model=LlamaModelHandle(path=resolve_model_path(config.model.model), vocab_only=True),
                             chat_template=config.model.chat_template)
