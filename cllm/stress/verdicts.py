"""What each scenario must show (issue 9's stress battery), as lists of failures: the CI tests assert
there are none, benchmarks/stress.py prints them beside the figures."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # results only; importing the scenarios would pull in llama.cpp and schemathesis
    from cllm.stress.disconnects import DisconnectResult
    from cllm.stress.faults import FaultResult
    from cllm.stress.flood import FloodResult, MemoryTrace, SlowReaderResult
    from cllm.stress.fuzz import FuzzResult
    from cllm.stress.holder_kill import HolderKillResult
    from cllm.stress.load import LoadResult
    from cllm.stress.sigterm import SigtermResult
    from cllm.stress.stalled import StalledResult

MIB = 1 << 20
RSS_GROWTH_LIMIT = 0.10  # load: RSS back within 10 % of the start
IDLE_AFTER_CLOSE_S = 1.0  # disconnects: engine idle this soon after the last close (a step is ~10-100 ms)
MEMORY_BOUND = 128 * MIB  # flood / slow readers: RSS may not grow more than this
MIN_FUZZ_REQUESTS = 500
# stalled readers: the server's RSS may grow this much for all of them together. Each unread stream
# holds one merged pending chunk (its unread text, ~6 bytes a token); before outputs became deltas and
# were merged, each step queued an output with a copy of the prompt: 16 streams of 4,000-token prompts
# and 8,000 tokens would have queued ~4 GB.
STALL_MEMORY_BOUND = 64 * MIB


def load_failures(r: LoadResult) -> list[str]:
    failures = []
    if r.lost or r.hung or r.completed != r.requests:
        failures.append(f"{r.lost} lost, {r.hung} hung of {r.requests} ({r.details})")
    if not r.idle_after.idle:
        failures.append(f"engine not idle after the run: {r.idle_after}")
    if r.rss_growth > RSS_GROWTH_LIMIT:
        failures.append(f"RSS grew {r.rss_growth:.1%} ({r.rss_start // MIB} -> {r.rss_end // MIB} MiB)")
    return failures


def disconnect_failures(r: DisconnectResult) -> list[str]:
    if r.idle_after_s is None:
        return ["engine never became idle after the last client left"]
    if r.idle_after_s > IDLE_AFTER_CLOSE_S:
        return [f"engine idle only {r.idle_after_s:.3f} s after the last close"]
    return []


def fuzz_failures(r: FuzzResult) -> list[str]:
    failures = [f"5xx or dropped: {e}" for e in r.server_errors[:10]]
    if r.requests < MIN_FUZZ_REQUESTS:
        failures.append(f"only {r.requests} fuzz requests (need {MIN_FUZZ_REQUESTS})")
    if not r.still_serves:
        failures.append("the server no longer serves after fuzzing")
    return failures


def _memory_failures(what: str, m: MemoryTrace) -> list[str]:
    if m.peak_growth > MEMORY_BOUND:
        return [f"{what}: RSS grew {m.peak_growth // MIB} MiB (bound {MEMORY_BOUND // MIB} MiB)"]
    return []


def flood_failures(r: FloodResult) -> list[str]:
    failures = _memory_failures("flood", r.memory)
    errors = {s: n for s, n in r.statuses.items() if s >= 500}
    if errors:
        failures.append(f"flood got 5xx: {errors}")
    if not r.statuses.get(429):
        failures.append(f"flood got no 429: {r.statuses}")
    if r.refused_without_retry_after:
        failures.append(f"{r.refused_without_retry_after} 429s without Retry-After")
    return failures


def slow_reader_failures(r: SlowReaderResult) -> list[str]:
    failures = _memory_failures("slow readers", r.memory)
    if r.chunks_read < r.readers:
        failures.append(f"slow readers read only {r.chunks_read} lines")
    return failures


def sigterm_failures(r: SigtermResult) -> list[str]:
    failures = [f"broken: {b}" for b in r.broken[:10]]
    if r.exit_code != 0:
        failures.append(f"exit status {r.exit_code}")
    if r.completed + r.clean_errors != r.accepted:
        failures.append(f"{r.accepted - r.completed - r.clean_errors} accepted requests ended neither way")
    return failures


def fault_failures(r: FaultResult) -> list[str]:
    failures = []
    if r.failed_decodes == 0:
        failures.append("the hook never failed a decode")
    if r.poisoned != "error":
        failures.append(f"the poisoned request ended with {r.poisoned!r}, not 'error'")
    if any(reason != "length" for reason in r.batch_mates + r.after):
        failures.append(f"other requests failed too: batch mates {r.batch_mates}, later {r.after}")
    return failures


def holder_kill_failures(r: HolderKillResult) -> list[str]:
    """Issue 27 item 1: no request hangs when the KV chunk holder dies under PD; each ends with its
    tokens or an error event, and the requests sent after the kill all complete."""
    failures = []
    for wave, outcomes in (("before the kill", r.before), ("after the kill", r.after)):
        for i, o in enumerate(outcomes):
            if o.status is None or not (o.completed or (o.error_event and o.done)):
                failures.append(f"request {i} sent {wave} did not end cleanly: status {o.status}, {o.detail}")
    incomplete = [o.detail or str(o.status) for o in r.after if not o.completed]
    if incomplete:
        failures.append(f"{len(incomplete)} of {len(r.after)} requests sent after the kill did not complete: {incomplete}")
    return failures


def stalled_failures(r: StalledResult) -> list[str]:
    failures = []
    growth = r.rss_peak - r.rss_start
    if growth > STALL_MEMORY_BOUND:
        failures.append(f"RSS grew {growth // MIB} MiB with {r.streams} stalled streams (bound {STALL_MEMORY_BOUND // MIB})")
    if r.idle_after_s is None:
        failures.append("the stalled requests never ended (slots still held)")
    if not r.others_ok:
        failures.append("a normal request failed while streams were stalled")
    return failures
