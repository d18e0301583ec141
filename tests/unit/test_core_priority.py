"""server.core_realtime: the engine core's loop thread takes SCHED_FIFO where the backend runs on a device and
the process may; the threads it starts afterwards stay ordinary; a CPU backend, ``off``, or a refusal leave
it as it was.

Whether this process may use real-time scheduling (root, CAP_SYS_NICE, RLIMIT_RTPRIO) is found by trying
it on a thread of its own; each test then asserts what must happen either way."""
from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.core_priority import REALTIME_PRIORITY, use_realtime_priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling policies are Linux's")

ORDINARY = os.SCHED_OTHER if sys.platform == "linux" else 0


def _in_thread(work):
    """``work()``'s result, run on a fresh thread (whose policy dies with it)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(work()))
    thread.start()
    thread.join()
    return box[0]


def _may_use_realtime() -> bool:
    def probe() -> bool:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except PermissionError:
            return False
        return True
    return _in_thread(probe)


def _policy() -> int:
    return os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK


def test_a_device_backend_takes_it_where_permitted_and_threads_started_after_stay_ordinary():
    permitted = _may_use_realtime()
    device = NullBackend(slots=2, device="torch", device_ms=1.0)  # forward on a (simulated) device

    def run() -> tuple[bool, int, int, int, int]:
        taken = use_realtime_priority("auto", device)
        mine, priority = _policy(), os.sched_getparam(0).sched_priority
        child = _in_thread(_policy)  # a thread the core starts afterwards (a compile, CUDA's own)
        return taken, mine, priority, child, os.sched_getscheduler(0) & os.SCHED_RESET_ON_FORK

    result = _in_thread(run)
    taken, mine, priority, child, reset = result
    assert taken is permitted, result
    if permitted:
        assert (mine, priority, reset) == (os.SCHED_FIFO, REALTIME_PRIORITY, os.SCHED_RESET_ON_FORK)
    else:
        assert (mine, priority) == (ORDINARY, 0)
    assert child == ORDINARY
    assert _policy() == ORDINARY  # the test's own thread: untouched


@pytest.mark.parametrize("setting, backend", [
    ("auto", functools.partial(NullBackend, slots=2)),  # a host backend (llama.cpp, torch on CPU): left alone
    ("off", functools.partial(NullBackend, slots=2, device="torch", device_ms=1.0)),
])
def test_a_host_backend_under_auto_and_off_leave_the_thread_ordinary(setting, backend):
    assert _in_thread(lambda: (use_realtime_priority(setting, backend()), _policy())) == (False, ORDINARY)


def test_on_takes_it_for_a_host_backend_too_where_permitted():
    permitted = _may_use_realtime()
    taken, policy = _in_thread(lambda: (use_realtime_priority("on", NullBackend(slots=2)), _policy()))
    assert (taken, policy) == ((True, os.SCHED_FIFO) if permitted else (False, ORDINARY))


def test_the_engine_core_process_runs_its_loop_at_realtime_priority_over_a_device():
    """The real core process (ProcessEngine): its loop thread (the process's main thread) is SCHED_FIFO
    where permitted, and it serves as before; the API process's thread stays ordinary."""
    from cllm.engine.process_engine import ProcessEngine
    from cllm.sampling.params import SamplingParams

    permitted = _may_use_realtime()
    config = load_config(None, environ={}, n_seq_max=4, engine_process="on", log_level="warning")
    engine = ProcessEngine(config, functools.partial(NullBackend, slots=4, device="torch", device_ms=1.0))

    async def run() -> tuple[int, list]:
        try:
            outs = [o async for o in engine.generate([300, 301], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
            return os.sched_getscheduler(engine.core_pid) & ~os.SCHED_RESET_ON_FORK, outs
        finally:
            await engine.shutdown()
    policy, outs = asyncio.run(run())
    assert policy == (os.SCHED_FIFO if permitted else ORDINARY)
    assert engine.core_realtime is permitted  # what the ready lines say
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    assert _policy() == ORDINARY


def test_the_ready_lines_say_where_the_loop_runs_and_at_what_priority():
    from types import SimpleNamespace

    from cllm.server.ready import _engine_text

    assert _engine_text(SimpleNamespace()) == "a thread of this process"
    assert _engine_text(SimpleNamespace(in_own_process=True, core_realtime=False)) == "its own process"
    assert "real-time priority" in _engine_text(SimpleNamespace(in_own_process=True, core_realtime=True))
