"""How busy the machine is: benchmarks wait for a quiet CPU, since other jobs skew timings."""
from __future__ import annotations

import time
from pathlib import Path


def cpu_idle_fraction(interval_s: float = 1.0) -> float:
    """Share of all CPUs' time spent idle over ``interval_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(interval_s)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(min_idle: float, timeout_s: float) -> float:
    """Block until the machine is at least ``min_idle`` idle, or ``timeout_s`` passes; returns the idle seen."""
    deadline = time.monotonic() + timeout_s
    idle = cpu_idle_fraction()
    while idle < min_idle and time.monotonic() < deadline:
        idle = cpu_idle_fraction(2.0)
    return idle
