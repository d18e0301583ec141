"""Real-time scheduling for the engine core's loop thread, so that a device never waits for a CPU.

Over a device whose forward runs asynchronously (the torch backend on CUDA, the null backend's simulated
device), the core's loop keeps the device fed: the lookahead launches step N+1 before the host reads step
N, so the device idles only when a loop iteration (outputs, commands, the next schedule) takes longer
than a forward. On a machine whose cores the API process, its clients and the core share, the woken core
often waited for a CPU behind them: at 256 streams on the 2-core VM the core's loop thread spent ~10 % of
the wall time runnable but not running (/proc schedstat), and a tenth of its iterations went past 6.5 ms
against the 5 ms device (benchmarks/results/core_priority_2026-12-02).

``SCHED_FIFO`` at the lowest real-time priority makes the woken loop thread run at once, ahead of every
ordinary thread. It sleeps in every device wait and every idle poll, so it takes no more CPU than it did;
the kernel still keeps 5 % of each CPU for ordinary threads (real-time throttling). Only this thread: the
pipe's sender thread started before it stays ordinary, and ``SCHED_RESET_ON_FORK`` makes the threads the core
starts afterwards (grammar compiles, CUDA's and torch's own) ordinary too. The API process and the in-process
engine thread are left as they are.

It needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least 1 (root outside a container; Docker does not grant
CAP_SYS_NICE by default); without them the core runs as before, and says so in the log.
"""
from __future__ import annotations

import logging
import os

from cllm.backends.base import Backend

log = logging.getLogger(__name__)

REALTIME_PRIORITY = 1  # the lowest SCHED_FIFO priority: above every ordinary thread, below the kernel's own


def use_realtime_priority(setting: str, backend: Backend) -> bool:
    """Give the calling thread real-time priority as ``setting`` (server.core_realtime) says: auto = where
    ``backend``'s forward overlaps host work (it runs on a device), on = wherever permitted, off = never.
    Whether the thread has it now."""
    if setting == "off" or (setting == "auto" and not backend.overlaps_host_work):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(REALTIME_PRIORITY))
    except (AttributeError, OSError) as err:  # not Linux, or not permitted
        log.log(logging.WARNING if setting == "on" else logging.INFO,
                "the engine core's loop runs at ordinary priority: real-time scheduling was refused (%s); "
                "CAP_SYS_NICE or an RLIMIT_RTPRIO >= 1 allows it (server.core_realtime)", err)
        return False
    log.info("the engine core's loop runs at real-time priority (SCHED_FIFO %d; server.core_realtime)", REALTIME_PRIORITY)
    return True
