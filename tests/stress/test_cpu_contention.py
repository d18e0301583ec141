"""The busy-CPU scenario (cllm/stress/cpu_contention.py) at CI size, in both engine modes: beside a process that
keeps a core busy, the server on its default thread count takes a thread away and completes every request."""
from __future__ import annotations

import os

import pytest

from cllm.stress.cpu_contention import cpu_contention_failures, run_cpu_contention
from cllm.stress.server_process import finish_server, start_server


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_a_busy_core_makes_the_engine_take_a_thread_away(engine_process: str) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable CPU: the default is one thread, there is nothing to take away")
    server = start_server("--log-level", "warning", "--set", f"engine_process={engine_process}", threads=None)
    try:
        result = run_cpu_contention(server, competitors=1)
    finally:
        finish_server(server)
    assert cpu_contention_failures(result) == []
    assert result.lowered >= 1 and result.requests >= 1  # (what the verdict says, spelled out)
