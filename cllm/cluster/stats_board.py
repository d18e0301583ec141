"""StatsBoard: where replicas post their engine stats, so the ingress can serve aggregated /metrics.

Each replica posts every ``period`` seconds; a post older than ``stale_after_s``
means the replica is gone (dead or replaced) and it no longer counts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import ray

from cllm.engine.stats import EngineStats, RunningRequestInfo

BOARD_NAME = "cllm-stats-board"


@dataclass(slots=True)
class ReplicaReport:
    """One replica's latest post."""

    replica: str  # replica actor id
    role: str  # "both", "prefill" or "decode"
    pid: int  # its process (for operators and the kill/drain tests)
    stats: EngineStats  # engine stats at post time
    running: list[RunningRequestInfo]  # live requests at post time
    posted_at: float = 0.0  # board clock (time.time) when it arrived
    model: str = ""  # the declared model it serves ("" on a single-model application)


@ray.remote(num_cpus=0)
class StatsBoard:
    """The latest report of every replica."""

    def __init__(self, stale_after_s: float = 6.0) -> None:
        self._reports: dict[str, ReplicaReport] = {}
        self._stale_after_s = stale_after_s

    def post(self, report: ReplicaReport) -> None:
        report.posted_at = time.time()
        self._reports[report.replica] = report

    def remove(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def reports(self) -> list[ReplicaReport]:
        now = time.time()
        for key in [k for k, r in self._reports.items() if now - r.posted_at > self._stale_after_s]:
            del self._reports[key]
        return list(self._reports.values())


def stats_board(namespace: str | None = "cllm") -> Any:
    """The board actor, created on first use."""
    return StatsBoard.options(name=BOARD_NAME, namespace=namespace, get_if_exists=True, lifetime="detached").remote()


_SUMMED = {"num_running", "num_waiting", "num_preempted", "slots_in_use", "slots_total",
           "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prompt_tokens_total",
           "generation_tokens_total", "num_preemptions", "tokens_per_s", "spec_proposed_tokens",
           "spec_accepted_tokens", "spec_verify_steps", "spec_emitted_tokens"}


def aggregate(stats: list[EngineStats]) -> EngineStats | None:
    """Replicas' stats as one engine's: counts and rates summed, KV usage averaged over replicas."""
    if not stats:
        return None
    values: dict[str, Any] = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(EngineStats) if f.name in _SUMMED}
    values["kv_usage"] = sum(s.kv_usage for s in stats) / len(stats)
    finished: dict[str, int] = {}
    for s in stats:
        for reason, n in s.requests_finished.items():
            finished[reason] = finished.get(reason, 0) + n
    values["requests_finished"] = finished
    return EngineStats(**values)
