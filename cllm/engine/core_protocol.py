"""The messages between the API server process and its engine-core process (see process_engine.py).

Plain dataclasses, pickled (protocol 5) into one bytes message each over a pipe. The API side
sends commands; the core answers every ``AddRequest`` with exactly one ``Admitted`` (so the API side
can count requests not yet in the engine's waiting queue), streams each step's outputs as one
``StepOutputs`` (each answered by one ``Settled`` once the API side has run it through), and says
``CoreStopped`` once as it ends.
"""
from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from cllm.engine.stats import EngineStats, RunningRequestInfo
from cllm.outputs import CompletionOutput, EmbeddingOutput, RequestMetrics, RequestOutput, Usage
from cllm.sampling.params import SamplingParams

Snapshot = tuple[EngineStats, list[RunningRequestInfo]]  # what stats() and running_requests() answer


# ------------------------------------------------------------------ API process -> core
@dataclass(slots=True)
class AddRequest:
    """Queue one request (validated and tokenised on the API side)."""

    request_id: str  # unique among live requests (checked on the API side)
    prompt: Any  # the prompt as given (text or ids): the engine keeps it with the request
    params: SamplingParams  # sampling settings, n included
    priority: int  # scheduler priority
    timeout_s: float | None  # per-request deadline from arrival; None = none
    prompt_ids: list[int]  # the tokenised prompt
    client: str | None = None  # who pays the request's cold grammar compile (max_compiles_per_client); None = nobody


@dataclass(slots=True)
class AbortRequest:
    """Abort a request (queued, running, or still having its grammar compiled)."""

    request_id: str


@dataclass(slots=True)
class EmbedRequest:
    """Embed inputs (texts or id lists, validated in the core: only it knows the backend's limits)."""

    job_id: int  # the API side's handle of the waiting call
    inputs: list[Any]


@dataclass(slots=True)
class Settled:
    """The API process has run a StepOutputs through (its outputs queued, then SETTLE_ITERATIONS loop
    iterations: the streams' tasks wrote them); the core holds the next outputs until then."""


@dataclass(slots=True)
class StopCore:
    """Abort what is left, free the engine, end the process."""


# ------------------------------------------------------------------ core -> API process
@dataclass(slots=True)
class CoreReady:
    """The engine loaded: what the API side needs to validate and tokenise on its own."""

    tokenizer: Any  # the backend's tokenizer, or None for llama.cpp's native one (the API side loads the vocabulary)
    max_model_len: int  # context length per sequence
    model_name: str  # the served model's default name
    device_text: str  # 'torch on cuda:0, bfloat16' for the ready lines
    max_num_seqs: int  # sequences at once
    snapshot: Snapshot  # initial stats
    determinism: Any = None  # the backend's Determinism (model.deterministic), for the ready lines and /v1/engine
    device_memory_bytes: int = 0  # device memory torch reserved in the core after the load (CUDA; 0 on a CPU)
    device_total_bytes: int = 0  # the size of the device it uses (0 on a CPU)
    supports_images: bool = False  # a vision encoder is loaded (prompts may hold images)
    realtime: bool = False  # the core's loop thread runs at real-time priority (server.core_realtime)


@dataclass(slots=True)
class CoreFailed:
    """The engine could not be built, or not served from its own process; the text says why."""

    error: str
    in_thread_ok: bool = False  # the engine loaded, only its tokenizer could not be sent: it can run in-process


@dataclass(slots=True)
class Admitted:
    """The answer to one AddRequest: queued (error None) or refused (a ValueError, QueueFullError …)."""

    request_id: str
    num_sequences: int  # the request's n: what the API side counted as pending for it
    error: BaseException | None
    aborted: bool = False  # aborted while its grammar compiled: it never reached the engine, its stream ends "abort"


@dataclass(slots=True)
class StepOutputs:
    """One step's outputs (deltas, packed by pack_output), in step order; with a fresh stats snapshot
    when one was due. ``settle``: the API process answers with Settled (not for the requests' first
    and last outputs that the core sends while it waits for one: see EngineCore._flush_ends)."""

    outputs: list[tuple]
    snapshot: Snapshot | None
    settle: bool = True


@dataclass(slots=True)
class EmbedDone:
    """The result of one EmbedRequest."""

    job_id: int
    result: list[EmbeddingOutput] | BaseException


@dataclass(slots=True)
class CoreStopped:
    """The core's loop ended: after StopCore (error None) or on a fatal error (its text)."""

    error: str | None


def pack_output(out: RequestOutput, *, continued: bool = False) -> tuple:
    """An output as plain tuples, for the pipe: pickling them is several times cheaper than pickling the
    dataclasses. Left out, as the API side has them or never reads them: the prompt and its ids (it
    sent them), and the whole ``text`` of a choice still running (only its delta is streamed; the
    whole text comes with the choice's finish_reason, as ``token_ids`` do). At 256 streams the full
    outputs were 205 kB a step and 4 ms to pickle; packed, a few kB.

    ``continued``: an earlier output of the request went out, so the API side holds what does not change
    (the prompt's usage and the request's first times). A plain delta then — one choice, running, text and
    token ids only, the case of nearly every streamed token — goes as a flat 7-tuple (see is_delta): per
    output 0.48 against 1.19 µs to pack and pickle, 0.90 against 1.45 to unpickle and unpack (issue 41,
    benchmarks/results/compact_delta_2026-11-29/)."""
    m, u = out.metrics, out.usage
    if continued and len(out.outputs) == 1 and not out.finished and out.error is None and out.prompt_logprobs is None:
        c = out.outputs[0]
        if (c.index == 0 and c.finish_reason is None and c.stop_reason is None and c.logprobs_delta is None
                and c.tool_calls is None and c.logprobs is None):
            return pack_delta(out.request_id, c.text_delta, c.token_ids_delta, u.completion_tokens, u.cached_tokens, m)
    choices = [(c.index, c.text if c.finish_reason is not None else "", c.token_ids, c.finish_reason, c.stop_reason,
                c.logprobs, c.text_delta, c.token_ids_delta, c.logprobs_delta, c.tool_calls) for c in out.outputs]
    return (out.request_id, choices, out.finished, (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time),
            out.error, out.prompt_logprobs)


def pack_delta(request_id: str, text_delta: str, token_ids_delta: list[int], completion_tokens: int,
               cached_tokens: int, metrics: RequestMetrics) -> tuple:
    """pack_output's flat form of a plain delta, from its parts (RequestGroup.plain_delta gives them)."""
    return (request_id, text_delta, token_ids_delta, completion_tokens, cached_tokens, metrics.first_token_time,
            metrics.last_token_time)


def is_delta(packed: tuple) -> bool:
    """Whether ``packed`` is pack_output's flat form of a plain delta (unpack it with unpack_delta)."""
    return len(packed) == 7 and isinstance(packed[1], str)


def unpack_output(packed: tuple, prompt: Any, prompt_ids: list[int]) -> RequestOutput:
    """pack_output's inverse (of the full form), with the request's prompt and ids put back."""
    rid, choices, finished, usage, metrics, error, prompt_logprobs = packed
    return RequestOutput(rid, prompt if isinstance(prompt, str) else None, prompt_ids,
                         [CompletionOutput(*c) for c in choices], finished, Usage(*usage), RequestMetrics(*metrics),
                         error, prompt_logprobs)


def unpack_delta(packed: tuple, previous: RequestOutput) -> RequestOutput:
    """pack_output's inverse of a plain delta, the rest taken from the request's ``previous`` output. The
    metrics object is the previous output's, updated: one per request, as the in-process engine's outputs
    share their request's."""
    rid, text_delta, token_ids_delta, completion, cached, first_token_time, last_token_time = packed
    metrics = previous.metrics
    metrics.first_token_time, metrics.last_token_time = first_token_time, last_token_time
    return RequestOutput(rid, previous.prompt, previous.prompt_token_ids,
                         [CompletionOutput(0, "", [], None, None, None, text_delta, token_ids_delta)], False,
                         Usage(previous.usage.prompt_tokens, completion, cached), metrics, None, previous.prompt_logprobs)


def frame(data: bytes) -> bytes:
    """``data`` framed as ``Connection.send_bytes`` frames it (what FrameReader and ``recv_bytes`` read)."""
    size = len(data)
    header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
    return header + data


def encode(message: object) -> bytes:
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> Any:
    return pickle.loads(data)


def portable_error(err: BaseException) -> BaseException:
    """``err`` if it survives pickling (ValueError, QueueFullError …); else a RuntimeError with its text,
    so one odd exception type never breaks the pipe."""
    try:
        pickle.loads(pickle.dumps(err, protocol=5))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


class FrameReader:
    """Reads ``Connection.send_bytes`` frames from a pipe without ever blocking: the event loop's
    ``add_reader`` makes the descriptor non-blocking, where ``Connection.recv_bytes`` fails on a message
    that has only partly arrived. Frames: a 4-byte big-endian signed length, or -1 and an 8-byte one."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()
        self.at_eof = False  # the writing end closed
        os.set_blocking(fd, False)

    def read(self, max_frames: int) -> list[bytes]:
        """Up to ``max_frames`` whole frames that have arrived (reading only what is there)."""
        frames = self._frames(max_frames)
        while len(frames) < max_frames and not self.at_eof:
            try:
                chunk = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.at_eof = True
                break
            self._buffer += chunk
            frames += self._frames(max_frames - len(frames))
        return frames

    def has_frame(self) -> bool:
        """Whether a whole frame is buffered already (read() stopped at its limit): the descriptor will not say so."""
        if len(self._buffer) < 4:
            return False
        (size,) = struct.unpack_from("!i", self._buffer)
        if size != -1:
            return len(self._buffer) >= 4 + size
        return len(self._buffer) >= 12 and len(self._buffer) >= 12 + struct.unpack_from("!Q", self._buffer, 4)[0]

    def _frames(self, limit: int) -> list[bytes]:
        frames = []
        while len(frames) < limit and len(self._buffer) >= 4:
            (size,) = struct.unpack_from("!i", self._buffer)
            start = 4
            if size == -1:
                if len(self._buffer) < 12:
                    break
                (size,) = struct.unpack_from("!Q", self._buffer, 4)
                start = 12
            if len(self._buffer) < start + size:
                break
            frames.append(bytes(self._buffer[start:start + size]))
            del self._buffer[:start + size]
        return frames
