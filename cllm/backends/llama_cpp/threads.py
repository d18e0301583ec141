"""How many threads llama.cpp computes with by default: one per physical core we may run on, within the CPU quota.

llama.cpp's own tools default to ``cpu_get_num_math()``: the physical cores
(hyper-thread siblings count once), because ggml's worker threads busy-wait on
each other and a second thread on the same core only steals its sibling's
execution units. cllm does the same, restricted to the CPUs this process is
allowed on (taskset, cgroups cpusets), read at run time from the machine, and
to the CPU time its cgroup may use (``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us``/``cpu.cfs_period_us`` in v1): a container given 1.5 CPUs
on a 16-core host sees 16 cores in its affinity mask.

A fractional quota is rounded down (at least 1), as uber's automaxprocs does;
the JVM, .NET and Go round up, which suits threads that block. ggml's threads
spin-wait for each other at every graph node, so a thread more than the quota
pays for burns the quota on spinning, the kernel throttles the whole cgroup for
the rest of its period (100 ms by default: ~10-40 decode steps of a small
model) and every step in flight stalls; and the engine's and server's own
Python threads are paid from the same quota.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], topology: Path = _TOPOLOGY) -> int:
    """Distinct physical cores among ``cpus`` (SMT siblings counted once); len(cpus) if unknown."""
    cores: set[str] = set()
    for cpu in cpus:
        siblings = topology / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_v2(directory: Path) -> float | None:
    """CPUs allowed by ``cpu.max`` ("max 100000" or "150000 100000") in one cgroup v2 directory."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    parts = text.split()
    try:
        if parts[0] == "max":
            return None
        period = int(parts[1]) if len(parts) > 1 else 100_000
        quota = int(parts[0])
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(directory: Path) -> float | None:
    """CPUs allowed by ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in one cgroup v1 cpu directory (-1 = none)."""
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 cpu controller's path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(root: Path, path: str | None) -> list[Path]:
    """``root/path`` and each directory above it up to ``root``, where they exist: every level's limit applies.
    In a container /proc/self/cgroup may name a host path that is not mounted here: then the root alone."""
    dirs = [root]
    parts = [p for p in (path or "").split("/") if p and p != ".."]
    for i in range(1, len(parts) + 1):
        d = root.joinpath(*parts[:i])
        if not d.is_dir():
            break
        dirs.append(d)
    return dirs


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT, proc_cgroup: Path = _PROC_CGROUP) -> float | None:
    """CPUs (maybe fractional) this process's cgroups allow, the tightest level's; None = no quota."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if v2 is not None:
        limits += [q for d in _ancestors(root, v2) if (q := _quota_v2(d)) is not None]
    if v1 is not None:
        for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
            if (root / mount).is_dir():
                limits += [q for d in _ancestors(root / mount, v1) if (q := _quota_v1(d)) is not None]
                break
    return min(limits) if limits else None


def quota_threads(limit: float | None) -> int | None:
    """Whole threads a CPU quota pays for: rounded down, at least 1 (see the module docstring)."""
    if limit is None:
        return None
    return max(1, math.floor(limit + 1e-9))


def default_n_threads(*, cpus: list[int] | None = None, cpu_limit: float | None = None,
                      read_cgroup: bool = True) -> int:
    """Threads for llama_decode when the config leaves n_threads unset: the physical cores we may run on,
    at most what the cgroup CPU quota pays for. (Arguments for tests: given CPUs and limit.)"""
    cores = max(1, physical_cores(usable_cpus() if cpus is None else cpus))
    limit = cgroup_cpu_limit() if cpu_limit is None and read_cgroup else cpu_limit
    quota = quota_threads(limit)
    return cores if quota is None else min(cores, quota)
