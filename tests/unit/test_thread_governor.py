"""ThreadGovernor over scripted step times (no clocks): down under contention, back up when it ends, no flapping."""
from __future__ import annotations

import pytest

from cllm.backends.llama_cpp.thread_governor import GovernorSettings, ThreadGovernor, work_class

DECODE = work_class(1, 100)
# A 2-core machine, as measured in issue 46: quiet, 2 threads beat 1 (1.8x); beside busy processes
# 2 spin-waiting threads are ~13x slower than 1.
QUIET = {2: 0.010, 1: 0.018}
BUSY = {2: 0.250, 1: 0.019}


def run(gov: ThreadGovernor, times: dict[int, float], steps: int, work=DECODE) -> list[int]:
    """Run ``steps`` steps; the thread count each ran with."""
    used = []
    for _ in range(steps):
        t = gov.threads_for_step()
        used.append(t)
        gov.observe(work, times[t])
    return used


def test_quiet_machine_keeps_every_thread_and_explores_down_rarely():
    gov = ThreadGovernor(top=2)
    used = run(gov, QUIET, 2000)
    assert gov.current == 2 and gov.changes == 0
    # one-thread tries: at 256, then after 512, 1024 more steps (each lost try doubles the interval)
    assert used.count(1) <= 3


def test_contention_takes_a_thread_away_after_patience_slow_steps():
    gov = ThreadGovernor(top=2)
    run(gov, QUIET, 20)
    used = run(gov, BUSY, 10)
    assert used[:3] == [2, 2, 2] and used[3] == 1  # the 3rd slow step decides
    assert gov.current == 1 and gov.changes == 1
    assert "slower than 2x" in gov.reason


def test_probes_stay_rare_while_busy_and_it_comes_back_when_quiet():
    gov = ThreadGovernor(top=2)
    run(gov, QUIET, 20)
    used = run(gov, BUSY, 1000)
    assert gov.current == 1
    assert used.count(2) <= 3 + 6  # the 3 slow steps, then probes at 16, 32, 64, ... steps
    quiet = run(gov, QUIET, 2000)
    assert gov.current == 2
    assert quiet.index(2) <= 1024  # the next probe (intervals capped) finds the machine quiet again
    assert quiet[-100:].count(2) >= 99


def test_a_lucky_probe_during_contention_does_not_make_it_flap():
    gov = ThreadGovernor(top=2, settings=GovernorSettings(probe_every=4))
    run(gov, QUIET, 20)
    run(gov, BUSY, 10)
    assert gov.current == 1
    changes = gov.changes
    # every probe is lucky (a quiet step) but the steps after it are busy: each return costs more waiting
    used = []
    for _ in range(400):
        t = gov.threads_for_step()
        used.append(t)
        gov.observe(DECODE, QUIET[t] if t == 2 and used[-2:-1] == [1] else BUSY[t])
    ups = gov.changes - changes
    assert ups <= 2 * 7  # intervals 8, 16, ... 512: a handful of round trips, not one every 4 steps
    assert used.count(2) < 60


def test_busy_from_the_start_is_found_by_trying_fewer_threads():
    gov = ThreadGovernor(top=2)
    used = run(gov, BUSY, 400)
    assert gov.current == 1
    assert used.index(1) == 256  # explore_every
    assert "took" in gov.reason


def test_work_classes_are_compared_only_with_themselves():
    gov = ThreadGovernor(top=2)
    prefill = work_class(256, 0)
    assert prefill != DECODE and work_class(1, 5000) != DECODE
    for _ in range(10):  # alternating cheap decodes and 30x dearer prefill chunks is no slowdown
        gov.observe(DECODE, 0.010)
        gov.observe(prefill, 0.300)
    assert gov.current == 2 and gov.changes == 0


def test_many_cores_step_down_one_at_a_time_while_slow():
    times = {t: (0.01 if t <= 5 else 0.2) for t in range(1, 9)}  # 3 of 8 cores busy elsewhere
    gov = ThreadGovernor(top=8)
    run(gov, {t: 0.01 for t in range(1, 9)}, 10)
    run(gov, times, 40)
    assert gov.current == 5


def test_probe_without_a_comparison_is_not_counted_as_lost():
    gov = ThreadGovernor(top=2, settings=GovernorSettings(probe_every=2))
    gov.current = 1
    assert gov.threads_for_step() == 1
    gov.observe(DECODE, 0.02)
    gov.observe(DECODE, 0.02)
    assert gov.threads_for_step() == 2  # probe
    gov.observe(work_class(64, 0), 0.001)  # work never seen at 1 thread: no verdict
    assert gov.current == 1 and gov._up_every == 2


def test_bad_top_is_refused():
    with pytest.raises(ValueError, match="top=0"):
        ThreadGovernor(top=0)


def test_a_class_of_prefill_chunks_spans_less_than_the_slow_factor():
    members: dict[tuple[int, int], list[int]] = {}
    for n in range(1, 4096):
        members.setdefault(work_class(n, 0), []).append(n)
    assert all(max(ns) / min(ns) < GovernorSettings().slow_factor for ns in members.values())
    assert work_class(1, 0) != work_class(2, 0) != work_class(3, 0) != work_class(4, 0)


def run_with_room(gov: ThreadGovernor, times: dict[int, float], room: float, steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        t = gov.threads_for_step(room)
        used.append(t)
        gov.observe(DECODE, times[t])
    return used


def test_room_for_a_thread_more_brings_it_back_within_a_few_steps():
    gov = ThreadGovernor(top=2)
    run_with_room(gov, QUIET, 2.0, 20)
    run_with_room(gov, BUSY, 1.2, 2000)  # the competitor leaves us one CPU: no room, step-count probes only
    assert gov.current == 1
    used = run_with_room(gov, QUIET, 2.0, 20)  # the competitor stops: both CPUs are ours again
    assert used.index(2) <= GovernorSettings().room_probe_every
    assert gov.current == 2


def test_no_room_means_no_early_probes():
    gov = ThreadGovernor(top=2)
    run_with_room(gov, QUIET, 2.0, 20)
    used = run_with_room(gov, BUSY, 1.1, 1000)
    assert used[3:].count(2) <= 5  # the step-count probes (32, 64, 128, 256, 512 steps apart)


def test_busy_from_the_start_is_found_early_when_the_room_is_short():
    gov = ThreadGovernor(top=2)
    used = run_with_room(gov, BUSY, 1.2, 20)  # two threads of ours and a competitor on two CPUs
    assert gov.current == 1 and used.index(1) <= GovernorSettings().room_probe_every


def test_a_room_that_misleads_costs_no_more_than_the_step_count_probes():
    # a cgroup quota: the mask's CPUs look idle, but a thread more only gets throttled
    gov = ThreadGovernor(top=2)
    run_with_room(gov, QUIET, 2.0, 20)
    run_with_room(gov, BUSY, 1.2, 10)
    assert gov.current == 1
    used = run_with_room(gov, BUSY, 2.0, 4000)
    assert gov.current == 1
    assert used.count(2) <= 2 * 10  # room probes 4, 8, ... 1024 steps apart, and the step-count ones
