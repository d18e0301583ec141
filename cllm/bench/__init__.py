"""`cllm bench`: offline (in-process), serving (HTTP) and comparison benchmarks.

Metric definitions follow `vllm bench serve` (see ``cllm.bench.metrics``).
The CLI lives in ``cllm.bench.cli:app``; the same runs are available from
Python through ``run_benchmark``.
"""
from __future__ import annotations

from cllm.bench.compare import BenchOptions, TargetSpec, run_benchmark
from cllm.bench.metrics import LatencyStats, RequestRecord, RunSummary, summarize_run
from cllm.bench.report import BenchReport

__all__ = [
    "BenchOptions", "BenchReport", "LatencyStats", "RequestRecord", "RunSummary", "TargetSpec",
    "run_benchmark", "summarize_run",
]
