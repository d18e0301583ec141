"""CpuRoom: how many of this process's CPUs it could have used lately — its own CPU time plus their idle time.

The thread governor learns from step times alone what a thread count costs, but
only by trying it; this tells it when trying is worth it. Over a window, the
CPUs in our affinity mask were either idle, running us, or running someone
else: ``(idle + ours) / wall`` is the number we could have had. At 1 thread
beside a busy process on 2 cores that is ~1 (no point trying 2); when the
process stops it becomes ~2 (try 2 now, not after the probe interval).
Linux only (``/proc/stat``); elsewhere, or when a read fails, ``None`` (the
governor then probes on its step count alone).
"""
from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

_PROC_STAT = Path("/proc/stat")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MIN_WINDOW_S = 0.25  # /proc/stat counts in 10 ms ticks: shorter windows are noise


def idle_seconds(cpus: set[int], proc_stat: Path = _PROC_STAT) -> float | None:
    """Idle + iowait seconds of ``cpus`` since boot, from /proc/stat's per-CPU lines; None if unreadable."""
    try:
        lines = proc_stat.read_text().splitlines()
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            if cpu in cpus:
                fields = rest.split()
                ticks += int(fields[3]) + int(fields[4])
                seen += 1
        except (ValueError, IndexError):
            return None
    return ticks / _CLOCK_TICKS if seen else None


def own_cpu_seconds() -> float:
    """CPU seconds (user + system) every thread of this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuRoom:
    """``sample()`` after each step: the CPUs we could have used over the last completed window (or None)."""

    def __init__(self, cpus: list[int], *, clock: Callable[[], float] = time.monotonic,
                 idle: Callable[[], float | None] | None = None, own: Callable[[], float] = own_cpu_seconds) -> None:
        cpu_set = set(cpus)
        self._clock, self._own = clock, own
        self._idle = idle if idle is not None else (lambda: idle_seconds(cpu_set))
        self._start = self._read()
        self.room: float | None = None  # the last completed window's answer

    def _read(self) -> tuple[float, float | None, float]:
        return self._clock(), self._idle(), self._own()

    def sample(self) -> float | None:
        """Close the window if it is long enough; the latest answer either way."""
        now = self._clock()
        if now - self._start[0] < MIN_WINDOW_S:
            return self.room
        end = self._read()
        (t0, idle0, own0), (t1, idle1, own1) = self._start, end
        self._start = end
        if idle0 is None or idle1 is None:
            self.room = None
        else:
            self.room = max(0.0, (idle1 - idle0) + (own1 - own0)) / (t1 - t0)
        return self.room
