"""The busy-CPU scenario (issue 46 §4): a real server on its default thread count beside processes that keep
cores busy. ggml's threads spin-wait for each other, so the engine must notice its slower steps and take a
thread away (the llama.cpp thread governor) while every request completes. Judged on the governor's decision
as the server reports it (/v1/engine, /metrics), never on wall-clock targets: the machine may be busy with
more than the scenario's own competitors."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cllm.stress.server_process import ServerProcess

# An engine core in its own process publishes its stats at most this late.
SNAPSHOT_WAIT_S = 10.0


@dataclass(slots=True)
class ContentionResult:
    requests: int  # requests sent beside the competitors (after one alone)
    completed: int  # of those, answered 200 with every token asked for
    errors: list[str]  # what the others got
    lowered: int  # times the governor took a thread away (compute_threads_lowered)
    threads_end: int | None  # compute_threads at the end
    metrics_threads: float | None  # cllm_compute_threads in /metrics
    metrics_lowered: float | None  # cllm_compute_threads_lowered_total in /metrics


@contextmanager
def busy_processes(n: int, settle_s: float = 0.0) -> Iterator[None]:
    """``n`` processes that each keep a CPU busy (``settle_s`` given to the OS to see them running),
    killed (by pid) on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(settle_s if n else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _stats(server: ServerProcess) -> dict:
    with server.http() as client:
        return client.get("/v1/engine").json()["stats"]


def _complete(server: ServerProcess, model: str, max_tokens: int) -> str | None:
    """None when the request got all its tokens, else what went wrong."""
    with server.http(timeout=600.0) as client:
        resp = client.post("/v1/completions", json={"model": model, "prompt": "Tell me about the sea.",
                                                   "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if resp.status_code != 200:
        return f"{resp.status_code}: {resp.text[:200]}"
    got = resp.json()["usage"]["completion_tokens"]
    return None if got == max_tokens else f"{got} of {max_tokens} tokens"


def _wait_lowered(server: ServerProcess) -> dict:
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    stats = _stats(server)
    while not stats.get("compute_threads_lowered") and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = _stats(server)
    return stats


def _metric(text: str, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def run_cpu_contention(server: ServerProcess, *, competitors: int = 1, max_requests: int = 12,
                       max_tokens: int = 64) -> ContentionResult:
    """One request alone (the quiet cost of a step, where the machine is quiet), then requests beside
    ``competitors`` busy processes until the governor has taken a thread away or ``max_requests`` ran (slow
    steps decide within 3 of them; a machine already busy when the quiet cost was measured is found by the
    governor's one-thread-fewer tries)."""
    with server.http() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
    errors = [e for e in [_complete(server, model, max_tokens)] if e]
    sent = completed = 0
    with busy_processes(competitors):
        while sent < max_requests:
            error = _complete(server, model, max_tokens)
            sent += 1
            completed += error is None
            errors += [error] if error else []
            if _stats(server).get("compute_threads_lowered"):
                break
        stats = _wait_lowered(server)
    with server.http() as client:
        text = client.get("/metrics").text
    return ContentionResult(sent, completed, errors, int(stats.get("compute_threads_lowered") or 0),
                            stats.get("compute_threads"), _metric(text, "cllm_compute_threads"),
                            _metric(text, "cllm_compute_threads_lowered_total"))


def cpu_contention_failures(r: ContentionResult) -> list[str]:
    failures = []
    if r.errors or r.completed != r.requests:
        failures.append(f"{r.completed} of {r.requests} requests completed: {r.errors[:3]}")
    if r.lowered < 1:
        failures.append(f"no thread taken away after {r.requests} requests beside busy processes "
                        f"(compute_threads {r.threads_end})")
    if r.metrics_lowered is None or r.metrics_lowered < r.lowered or r.metrics_threads is None or r.metrics_threads < 1:
        failures.append(f"/metrics: cllm_compute_threads {r.metrics_threads}, "
                        f"cllm_compute_threads_lowered_total {r.metrics_lowered} (engine says lowered {r.lowered})")
    return failures
