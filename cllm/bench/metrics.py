"""Benchmark metric math, as defined by `vllm bench serve`.

All times are seconds internally; summaries report milliseconds.

- TTFT: from sending a request to its first non-empty chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with > 1 output token.
- ITL: the gap between successive non-empty chunks, pooled over requests.
- E2E latency (``e2el``): from sending to the last chunk.
- Goodput: completed requests per second that met every given SLO.
- Throughput: completed requests, output tokens, and input + output tokens
  per second of benchmark duration (first send to last finish).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one benchmark request."""

    index: int  # position in the workload
    prompt_tokens: int  # prompt length in tokens
    max_tokens: int  # output tokens asked for
    start: float  # send time, seconds since the run started
    success: bool = False  # finished without error
    output_tokens: int = 0  # tokens generated (server usage when given, else chunks)
    ttft: float | None = None  # seconds from send to first non-empty chunk
    e2e: float | None = None  # seconds from send to the last chunk
    itl: list[float] = field(default_factory=list)  # seconds between successive non-empty chunks
    error: str | None = None  # failure reason (HTTP status + body, or exception text)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below 2 tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class LatencyStats:
    """Distribution of one latency metric, in milliseconds."""

    mean: float  # arithmetic mean
    median: float  # 50th percentile
    p90: float  # 90th percentile (linear interpolation, as numpy)
    p99: float  # 99th percentile
    std: float  # population standard deviation
    count: int  # samples


@dataclass(slots=True)
class RunSummary:
    """Aggregate results of one run (one target at one load level)."""

    num_requests: int  # requests sent
    completed: int  # requests that succeeded
    failed: int  # requests that failed
    failure_reasons: dict[str, int]  # failure reason -> count
    duration_s: float  # first send to last finish
    total_input_tokens: int  # prompt tokens of completed requests
    total_output_tokens: int  # output tokens of completed requests
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # (input + output) tokens per second
    goodput: float | None  # requests per second meeting all SLOs; None without SLOs
    ttft: LatencyStats | None  # time to first token (ms)
    tpot: LatencyStats | None  # time per output token (ms)
    itl: LatencyStats | None  # inter-token latency (ms)
    e2el: LatencyStats | None  # end-to-end latency (ms)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"invalid percentile q={q!r}: must be in [0, 100]")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_stats(values_s: Iterable[float]) -> LatencyStats | None:
    """Mean/median/p90/p99/std of latencies given in seconds, reported in ms; None if empty."""
    ms = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if ms.size == 0:
        return None
    return LatencyStats(
        mean=float(ms.mean()),
        median=float(np.percentile(ms, 50)),
        p90=float(np.percentile(ms, 90)),
        p99=float(np.percentile(ms, 99)),
        std=float(ms.std()),
        count=int(ms.size),
    )


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition(":")
        name = "e2el" if name == "e2e" else name
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"invalid SLO {part!r}: use NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid SLO {part!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"invalid SLO {part!r}: the limit must be > 0 ms")
        slo[name] = ms
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request whose TTFT / TPOT / E2E are all within the limits (ms).

    A request with a single output token has no TPOT; as in vLLM it counts as 0.
    """
    if not record.success or record.ttft is None or record.e2e is None:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(observed[name] * 1000.0 <= limit for name, limit in slo.items())


def failure_reasons(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failure reason -> count, most common first."""
    counts = Counter(r.error or "unknown error" for r in records if not r.success)
    return dict(counts.most_common())


def summarize_run(records: Sequence[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> RunSummary:
    """Aggregate per-request records of one run lasting ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"invalid duration_s={duration_s!r}: must be > 0")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    return RunSummary(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        failure_reasons=failure_reasons(records),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=None if good is None else good / duration_s,
        ttft=latency_stats(r.ttft for r in ok if r.ttft is not None),
        tpot=latency_stats(t for r in ok if (t := r.tpot) is not None),
        itl=latency_stats(gap for r in ok for gap in r.itl),
        e2el=latency_stats(r.e2e for r in ok if r.e2e is not None),
    )


@dataclass(slots=True)
class StreamTimer:
    """Turns the arrival times of one streamed request's chunks into a RequestRecord.

    Times are ``time.perf_counter()`` seconds; ``run_start`` is the run's t=0.
    Only non-empty chunks (text or tokens) count for TTFT and ITL.
    """

    record: RequestRecord  # filled in place
    sent_at: float  # perf_counter when the request was sent
    last_chunk_at: float | None = None  # perf_counter of the latest non-empty chunk
    chunks: int = 0  # non-empty chunks seen

    @classmethod
    def begin(cls, index: int, prompt_tokens: int, max_tokens: int, run_start: float, now: float) -> StreamTimer:
        """Start timing a request sent at ``now``."""
        record = RequestRecord(index=index, prompt_tokens=prompt_tokens, max_tokens=max_tokens, start=now - run_start)
        return cls(record=record, sent_at=now)

    def chunk(self, now: float) -> None:
        """A non-empty chunk arrived at ``now``."""
        if self.last_chunk_at is None:
            self.record.ttft = now - self.sent_at
        else:
            self.record.itl.append(now - self.last_chunk_at)
        self.last_chunk_at = now
        self.chunks += 1

    def finish(self, now: float, output_tokens: int | None = None) -> RequestRecord:
        """The stream ended normally; ``output_tokens`` from usage, else the chunk count."""
        self.record.e2e = now - self.sent_at
        self.record.output_tokens = self.chunks if output_tokens is None else output_tokens
        self.record.success = self.chunks > 0 or self.record.output_tokens > 0
        if not self.record.success:
            self.record.error = "empty response: no output chunk"
        return self.record

    def fail(self, now: float, reason: str) -> RequestRecord:
        """The request failed for ``reason``."""
        self.record.e2e = now - self.sent_at
        self.record.output_tokens = self.chunks
        self.record.success = False
        self.record.error = reason
        return self.record
