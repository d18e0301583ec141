"""The engine core: an LLMEngine stepping in a process of its own (the child side of process_engine.py).

Why a process: in-process, the engine thread and the server's event loop share one GIL. On a GPU
the engine releases it at every CUDA synchronisation and must take it back from a loop that is busy
streaming hundreds of tokens per step; CPython hands it over only after the switch interval (5 ms)
or when the loop lets go, so each step paid up to 5 ms per synchronisation, and the loop's and the
engine's Python ran one after the other (engine_overhead.py --step-ms 8 at 256 streams: the forward
waited 2 ms on average, p90 5.3 ms, to get the GIL back, and the server kept 54 % of the engine's
tokens/s). Here the core's only other thread is a sender that writes finished messages (the GIL
released while it writes), so the engine steps at its offline pace and the API process streams on
its own core.

The loop: run the commands that came in (adds, aborts, embeddings), step, send the step's outputs as
one message. An idle engine that receives requests first gathers the burst (as AsyncLLM does) so that
closed-loop clients' next requests are prefilled together. A grammar's cold compile runs in a worker
thread, never in the loop. While the API process is behind (it has not settled the last StepOutputs,
or a message waits for room in the pipe), each request's news is held (LLMEngine.hold_outputs) and sent
as one output once it has caught up: a busy event loop gets fewer, larger outputs (several tokens to one
SSE event) instead of a backlog, and the engine keeps stepping.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import dataclasses
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from cllm.backends.base import Backend
from cllm.config import CllmConfig
from cllm.engine import async_llm
from cllm.engine.core_priority import use_realtime_priority
from cllm.engine.core_protocol import (
    AbortRequest, AddRequest, Admitted, CoreFailed, CoreReady, CoreStopped, EmbedDone, EmbedRequest, Snapshot,
    Settled, StepOutputs, StopCore, decode, encode, frame, pack_delta, pack_output, portable_error,
)
from cllm.engine.llm_engine import LLMEngine
from cllm.errors import QueueFullError
from cllm.server.client_quota import compile_quota
from cllm.structured.limits import CompileBusyError, charge_compiles_to
from cllm.gc_freeze import freeze_live_objects
from cllm.outputs import RequestOutput, merge_outputs
from cllm.router.memory import cuda_reserved_bytes, cuda_total_bytes

log = logging.getLogger("cllm.engine")
COMPILE_POLL_S = 0.005  # how often an idle core looks at grammar compiles in flight
# StepOutputs the API process may have unsettled (see Settled) before the core holds the next outputs,
# merging each request's: the process-mode form of AsyncLLM's one outstanding hand-over. Sending every
# step whenever the pipe had room kept several steps in flight through the API process's loop (read,
# then each stream's pump, then its writer, an iteration each), none merged: at 256 streams on an H100
# the loop sent one SSE event per token, ~30 µs each, and was the bottleneck beside a faster engine.
MAX_UNSETTLED = 1
# Requests whose grammar compiles at once in the core (each waits in the grammar cache's pool within
# its compile budget, as an in-process request's thread does); one more gets CompileBusyError (429).
MAX_COMPILING = 32


@dataclass(slots=True)
class CoreSpec:
    """What the child process needs to build its engine (pickled to it)."""

    config: CllmConfig
    backend_factory: Callable[[], Backend] | None = None  # None: the backend the config names


def run_engine_core(spec: CoreSpec, commands: Connection, outputs: Connection) -> None:
    """The child process's main: build the engine, say ready (or why not), run the loop, exit."""
    # Ctrl-C, and SIGTERM from systemd, a container's init or `kill -- -PGID`, reach the whole process
    # group: the API process drains the streams within shutdown_grace_s and then stops us (StopCore,
    # killed past its join timeout). Dying on the signal would cut every stream at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    async_llm._name_os_thread("cllm-core")
    sender = Sender(outputs)
    try:
        engine = LLMEngine(spec.config, backend=spec.backend_factory() if spec.backend_factory else None)
    except BaseException as err:  # the API process reports it and exits
        sender.send(CoreFailed(f"{type(err).__name__}: {err}"))
        sender.close()
        return
    realtime = use_realtime_priority(spec.config.server.core_realtime, engine.backend)
    try:
        ready = encode(_ready(engine, spec.config, realtime))
    except Exception as err:  # a tokenizer that does not pickle: the API process may run the engine itself
        engine.close()
        sender.send(CoreFailed(f"its tokenizer cannot be sent to the API process ({type(err).__name__}: {err})",
                               in_thread_ok=True))
        sender.close()
        return
    freeze_live_objects()
    sender.send_encoded(ready)
    EngineCore(engine, commands, sender).run()


def _ready(engine: LLMEngine, config: CllmConfig, realtime: bool) -> CoreReady:
    from cllm.server.ready import device_text  # the same words as an in-process engine's

    # llama.cpp's tokenizer is a native handle: its pointer would pickle as a number and crash the API
    # process, which loads the vocabulary itself instead (process_engine._load_tokenizer).
    tokenizer: Any = None if engine.backend.name == "llama_cpp" else engine.tokenizer
    return CoreReady(tokenizer, engine.max_model_len, async_llm.model_name_of(engine), device_text(_Holder(engine), config),
                     engine.backend.capacity.max_num_seqs, (engine.stats(), engine.running_requests()),
                     engine.backend.determinism, cuda_reserved_bytes(), cuda_total_bytes(), engine.supports_images,
                     realtime)


@dataclass(slots=True)
class _Holder:
    engine: LLMEngine  # device_text looks for an AsyncLLM's ``engine``


class Sender:
    """Writes messages to the pipe without ever blocking a step. A message goes out in the call that sends
    it while the pipe has room; what does not fit (the API process behind), and everything sent after it,
    waits in order for a thread of its own, which writes as the pipe drains (the GIL released while it
    waits). Handing every message to that thread made each one wait for the thread to get the GIL from
    the busy step loop, and each partial write of a message larger than the pipe wait again: a request's
    first token and its end, which its client waits on, crossed later (issue 41)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: collections.deque[memoryview] = collections.deque()  # frames (or their rest) in order
        self._closing = False
        self.broken = False  # the API process is gone
        self._thread = threading.Thread(target=self._run, name="cllm-core-send", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        rest: memoryview | None = memoryview(frame(data))
        with self._lock:
            if self.broken or self._closing:
                return
            if not self._pending:
                rest = self._write(rest)
            if rest is not None:
                self._pending.append(rest)
                self._ready.notify()

    def backlog(self) -> int:
        """Messages (or their rest) waiting for room in the pipe."""
        return len(self._pending)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop (bounded: a dead reader must not hold the exit)."""
        with self._lock:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout_s)

    def _write(self, data: memoryview) -> memoryview | None:
        """Write what fits (under the lock); the unwritten rest, or None."""
        try:
            n = os.write(self._fd, data)
        except BlockingIOError:
            return data
        except OSError:
            self.broken = True
            self._pending.clear()
            return None
        return data[n:] if n < len(data) else None

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._ready.wait()
                if not self._pending or self.broken:
                    return  # closing, and everything sent
            poller.poll(100)  # room in the pipe (or 0.1 s, to look again)
            with self._lock:
                while self._pending:
                    head = self._pending[0]
                    rest = self._write(head)
                    if self.broken or (rest is not None and len(rest) == len(head)):
                        break  # gone, or still full
                    if rest is None:
                        self._pending.popleft()
                    else:
                        self._pending[0] = rest


class EngineCore:
    """The loop of the engine process; ``run()`` returns after StopCore, a fatal error, or a lost parent."""

    def __init__(self, engine: LLMEngine, commands: Connection, sender: Sender) -> None:
        self.engine = engine
        self._commands = commands
        # One poll object for the step loop's "any command?" (Connection.poll builds a selector per call:
        # a third of the engine core's CPU at one stream over a zero-cost backend, py-spy).
        self._poller = select.poll()
        self._poller.register(commands.fileno(), select.POLLIN)
        self._sender = sender
        self._stopping = False
        self._embeds: list[EmbedRequest] = []
        self._compiling: dict[str, tuple[concurrent.futures.Future, AddRequest]] = {}
        # One waiting thread per compiling request (bounded by MAX_COMPILING), so each one's compile budget
        # runs from its arrival, as in-process; the compiles themselves run in the grammar cache's pool.
        self._compiler = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_COMPILING, thread_name_prefix="cllm-grammar")
        # Cold compiles charged per client (server.max_compiles_per_client), as the API process's quota
        # does in-process: the same counts, the same 429.
        self._compile_quota = compile_quota(engine.config)
        # when requests finished whose clients have not sent another since (oldest first; see async_llm's BURST_*)
        self._owed: collections.deque[float] = collections.deque()
        self._held: dict[str, RequestOutput] = {}  # outputs not sent yet (the API process is behind), merged
        self._scored: set[str] = set()  # requests whose prompt logprobs have been sent
        self._streaming: set[str] = set()  # requests with an output sent and more to come (see _flush_ends)
        self._published_at = 0.0
        self._changed = True  # commands ran or steps ran since the last stats sent
        self._steps_short = False  # the last step was short and nothing waits (see async_llm.HANDOVER_INTERVAL_S)
        self._sent_at = 0.0  # time.monotonic() of the last StepOutputs sent
        self._unsettled = 0  # StepOutputs sent that the API process has not answered with Settled yet

    def run(self) -> None:
        error: str | None = None
        try:
            self._loop()
        except BaseException as err:  # a bug or a fatal backend error: the API side fails every stream
            log.exception("engine core died")
            error = f"{type(err).__name__}: {err}"
        finally:
            self._finish(error)

    def _loop(self) -> None:
        while not self._stopping:
            was_idle = not self.engine.has_unfinished()
            taken = self._take_commands(0.0)
            self._run_embeds()
            self._admit_compiled()
            if not self.engine.has_unfinished():
                self._maybe_flush(now=True)  # gone idle: no later step will send what is held
                if self._changed:  # gone idle: no step will carry the stats any more
                    self._send_snapshot()
                self._idle()
                continue
            if was_idle:
                self._gather_burst(taken)
            # Before a step: what the API process settled meanwhile can go; and if this step may admit a
            # prefill (it may be long), nothing held waits for it beyond the API process's settling.
            self._maybe_flush(now=bool(taken or self.engine.scheduler.num_waiting))
            started = time.monotonic()
            # Behind: running requests' news stays in the engine, made into one output each when sent.
            self.engine.hold_outputs = self._unsettled >= MAX_UNSETTLED or self._sender.backlog() > 0
            outputs = self.engine.step()
            self._steps_short = async_llm.steps_are_short(time.monotonic() - started, self.engine)
            self._changed = True
            self._owe(sum(1 for out in outputs if out.finished))
            self._deliver(outputs)

    def _idle(self) -> None:
        """Housekeeping a unit at a time when no client is expected back (see AsyncLLM._idle_work), else
        wait for a command."""
        self._owe(0)
        if not self._owed and self.engine.idle_work():
            return
        self._take_commands(COMPILE_POLL_S if self._compiling else async_llm.IDLE_WAIT_S)

    def _take_commands(self, wait_s: float) -> int:
        """Run every command that has come (waiting up to ``wait_s`` for the first); how many adds."""
        adds = 0
        try:
            ready = self._poller.poll(math.ceil(wait_s * 1000))
            while ready and not self._stopping:
                adds += self._run_command(decode(self._commands.recv_bytes()))
                ready = self._poller.poll(0)
        except (EOFError, OSError):  # the API process is gone: nobody to serve
            self._stopping = True
        return adds

    def _run_command(self, command: object) -> int:
        if isinstance(command, Settled):  # changes nothing the stats show
            self._unsettled -= 1
            return 0
        self._changed = True
        if isinstance(command, AddRequest):
            if self._owed:  # a client came back
                self._owed.popleft()
            key = command.params.constraint_key
            if key is not None and not self.engine.structured.cache.is_cached(key):  # ms to s: off the loop
                self._start_compile(command)
            else:
                self._add(command)
            return 1
        if isinstance(command, AbortRequest):
            self._abort(command.request_id)
        elif isinstance(command, EmbedRequest):
            self._embeds.append(command)
        elif isinstance(command, StopCore):
            self._stopping = True
        return 0

    def _add(self, command: AddRequest) -> None:
        error: BaseException | None = None
        try:
            self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                    priority=command.priority, timeout_s=command.timeout_s, prompt_ids=command.prompt_ids)
        except (ValueError, TypeError, QueueFullError) as err:  # this request's fault or the queue's bound
            error = portable_error(err)
        self._sender.send(Admitted(command.request_id, command.params.n, error))

    def _start_compile(self, command: AddRequest) -> None:
        if len(self._compiling) >= MAX_COMPILING:
            busy = CompileBusyError(f"{MAX_COMPILING} grammar compiles are queued in the engine (other requests' "
                                    "constraints); retry later")
            self._sender.send(Admitted(command.request_id, command.params.n, busy))
            return
        # A fresh context per compile: the payer set in it cannot leak to the worker thread's next task.
        future = self._compiler.submit(contextvars.Context().run, self._compile, command)
        self._compiling[command.request_id] = (future, command)

    def _compile(self, command: AddRequest) -> None:
        """A worker thread: compile (or join the compile of) the request's grammar, charged to its client."""
        if command.client is not None and self._compile_quota is not None:
            charge_compiles_to(self._compile_quota.payer(command.client))
        self.engine.structured.compile(command.params)

    def _admit_compiled(self) -> None:
        for rid, (future, command) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            error = future.exception()
            if error is not None:
                self._sender.send(Admitted(rid, command.params.n, portable_error(error)))
            else:
                self._add(command)

    def _abort(self, request_id: str) -> None:
        pending = self._compiling.pop(request_id, None)
        if pending is not None:  # never reached the engine: its add is answered, its stream ends "abort"
            self._sender.send(Admitted(request_id, pending[1].params.n, None, aborted=True))
            return
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Merge outputs into those held, then send them all if the API process is ready for them."""
        self._hold(outputs)
        self._maybe_flush()

    def _hold(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            prev = self._held.get(out.request_id)
            self._held[out.request_id] = out if prev is None else merge_outputs(prev, out)

    def _maybe_flush(self, now: bool = False) -> None:
        """Send what is held unless the API process has not settled the last StepOutputs yet (it is
        behind: each request's outputs merge meanwhile, so a busy event loop gets several tokens per
        SSE event instead of a backlog of one-token outputs; see MAX_UNSETTLED), or, unless ``now``,
        steps are short and the last message went out less than async_llm.HANDOVER_INTERVAL_S ago (a
        message costs both processes a wake-up and a system call whatever it carries)."""
        if not (self._held or self.engine.has_held_outputs()) or self._sender.backlog():
            return
        if self._unsettled >= MAX_UNSETTLED:
            self._flush_ends()
            return
        if not now and self._steps_short and time.monotonic() - self._sent_at < async_llm.HANDOVER_INTERVAL_S:
            return
        self._flush()

    def _flush(self) -> None:
        deltas = self._take_held() if self.engine.has_held_outputs() else []
        if self._held or deltas:
            self._send(deltas + [self._pack(out) for out in self._held.values()], self._snapshot_if_due())
            self._held.clear()

    def _take_held(self) -> list[tuple]:
        """The engine's held groups (held while the API process was behind: see the loop): a plain delta
        of a request already streaming, with nothing of it held here, packed straight from its group
        (RequestGroup.plain_delta, core_protocol.pack_delta); any other made into an output and held."""
        deltas: list[tuple] = []
        for group in self.engine.take_held_groups():
            rid = group.group_id
            news = group.plain_delta() if rid in self._streaming and rid not in self._held else None
            if news is None:
                self._hold([group.make_output()])
            else:
                deltas.append(pack_delta(rid, *news, group.children[0].metrics))
        return deltas

    def _flush_ends(self) -> None:
        """Send the held outputs that are their requests' first or last (a client waits on the first
        token, and on the end before it sends its next request) while the rest keep merging until the API
        process settles: a settling round trip took ~30 ms at 256 streams over the asynchronous simulated
        device (the first token, and the end, waited for it)."""
        due = [rid for rid, out in self._held.items() if out.finished or rid not in self._streaming]
        if due:  # not settled: the outputs held for the API process keep waiting for the Settled it owes
            self._sender.send(StepOutputs([self._pack(self._held.pop(rid)) for rid in due], None, settle=False))

    def _send(self, packed: list[tuple], snapshot: Snapshot | None) -> None:
        self._sender.send(StepOutputs(packed, snapshot))
        self._sent_at = time.monotonic()
        self._unsettled += 1

    def _pack(self, out: RequestOutput) -> tuple:
        """pack_output, with a request's prompt logprobs sent once (the API side keeps them): the engine
        hands the complete list on every output after it is scored."""
        continued = out.request_id in self._streaming
        if out.prompt_logprobs is not None:
            if out.request_id in self._scored:
                out = dataclasses.replace(out, prompt_logprobs=None)
            else:
                self._scored.add(out.request_id)
        if out.finished:
            self._scored.discard(out.request_id)
            self._streaming.discard(out.request_id)
        else:
            self._streaming.add(out.request_id)
        return pack_output(out, continued=continued)

    def _run_embeds(self) -> None:
        """Every queued embed call in one backend pass (see AsyncLLM._run_embed_jobs); bad input fails its call only."""
        jobs, self._embeds = self._embeds, []
        valid: list[tuple[EmbedRequest, list[list[int]]]] = []
        for job in jobs:
            try:
                valid.append((job, self.engine.embedding_token_ids(job.inputs)))
            except (ValueError, TypeError) as err:
                self._sender.send(EmbedDone(job.job_id, err))
        if not valid:
            return
        try:
            outputs = self.engine.embed_token_ids([ids for _, token_ids in valid for ids in token_ids])
        except Exception as err:  # a backend failure fails these calls; the engine lives on
            for job, _ in valid:
                self._sender.send(EmbedDone(job.job_id, portable_error(err)))
            return
        start = 0
        for job, token_ids in valid:
            self._sender.send(EmbedDone(job.job_id, outputs[start:start + len(token_ids)]))
            start += len(token_ids)

    def _gather_burst(self, taken: int) -> None:
        """Take in requests still arriving before the first step (AsyncLLM._gather_burst's windows): until
        the pipe has been quiet for BURST_EXPECT_QUIET_S while clients are owed or two or more came in
        at once, else BURST_QUIET_S; for at most BURST_(EXPECT_)MAX_WAIT_S."""
        self._owe(0)
        expected = bool(self._owed)
        now = time.monotonic()
        deadline = now + (async_llm.BURST_EXPECT_MAX_WAIT_S if expected else async_llm.BURST_MAX_WAIT_S)
        quiet_since = now
        while not self._stopping and now < deadline:
            long_window = self._owed or (not expected and taken >= 2)
            window = async_llm.BURST_EXPECT_QUIET_S if long_window else async_llm.BURST_QUIET_S
            came = self._take_commands(max(0.0, min(quiet_since + window, deadline) - now))
            taken += came
            now = time.monotonic()
            if came:
                quiet_since = now
            elif now - quiet_since >= window:
                break
        self._admit_compiled()

    def _owe(self, finished: int) -> None:
        now = time.monotonic()
        self._owed.extend([now] * finished)
        while self._owed and self._owed[0] < now - async_llm.BURST_EXPECT_WITHIN_S:
            self._owed.popleft()

    def _snapshot_if_due(self) -> Snapshot | None:
        if time.monotonic() - self._published_at < async_llm.PUBLISH_EVERY_S:
            return None
        self._published_at = time.monotonic()
        return self.engine.stats(), self.engine.running_requests()

    def _send_snapshot(self) -> None:
        self._changed = False
        self._published_at = time.monotonic()
        self._sender.send(StepOutputs([], (self.engine.stats(), self.engine.running_requests())))
        self._unsettled += 1  # the API process settles every StepOutputs

    def _finish(self, error: str | None) -> None:
        """Abort what is left (its final outputs go out), free the engine, say stopped, flush the pipe."""
        self._compiler.shutdown(wait=False, cancel_futures=True)
        if error is None:
            for rid in list(self._compiling):
                self._abort(rid)
            for rid in self.engine.request_ids():
                self._abort(rid)
        self._flush()
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")
        self._sender.send(CoreStopped(error))
        self._sender.close()
