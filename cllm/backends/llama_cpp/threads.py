"""How many threads llama.cpp computes with by default: one per physical core we may run on.

llama.cpp's own tools default to ``cpu_get_num_math()``: the physical cores
(hyper-thread siblings count once), because ggml's worker threads busy-wait on
each other and a second thread on the same core only steals its sibling's
execution units. cllm does the same, restricted to the CPUs this process is
allowed on (taskset, cgroups cpusets), read at run time from the machine.
"""
from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


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


def default_n_threads() -> int:
    """Threads for llama_decode when the config leaves n_threads unset."""
    return max(1, physical_cores(usable_cpus()))
