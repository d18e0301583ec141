"""CpuRoom: the CPUs this process could have used lately, from /proc/stat idle time and its own CPU time."""
from __future__ import annotations

import pytest

from cllm.backends.llama_cpp.cpu_room import MIN_WINDOW_S, CpuRoom, idle_seconds

STAT = """cpu  100 0 100 1000 10 0 0 0 0 0
cpu0 50 0 50 400 5 0 0 0 0 0
cpu1 50 0 50 600 5 0 0 0 0 0
cpu2 0 0 0 900 0 0 0 0 0 0
intr 12345
"""


def test_idle_seconds_sums_idle_and_iowait_of_our_cpus(tmp_path, monkeypatch):
    import cllm.backends.llama_cpp.cpu_room as cpu_room
    monkeypatch.setattr(cpu_room, "_CLOCK_TICKS", 100)
    path = tmp_path / "stat"
    path.write_text(STAT)
    assert idle_seconds({0, 1}, path) == pytest.approx((405 + 605) / 100)
    assert idle_seconds({2}, path) == pytest.approx(9.0)
    assert idle_seconds({7}, path) is None  # none of ours listed
    assert idle_seconds({0}, tmp_path / "missing") is None
    path.write_text("cpu0 1 2\n")
    assert idle_seconds({0}, path) is None


class Fake:
    def __init__(self) -> None:
        self.t, self.idle, self.own = 0.0, 0.0, 0.0


def _room(fake: Fake) -> CpuRoom:
    return CpuRoom([0, 1], clock=lambda: fake.t, idle=lambda: fake.idle, own=lambda: fake.own)


def test_room_is_our_cpu_time_plus_idle_time_per_second():
    fake = Fake()
    room = _room(fake)
    assert room.sample() is None  # no window yet
    fake.t, fake.idle, fake.own = 1.0, 0.0, 1.0  # one thread of ours, the other CPU busy elsewhere
    assert room.sample() == pytest.approx(1.0)
    fake.t, fake.idle, fake.own = 2.0, 1.0, 2.0  # the other CPU idle now
    assert room.sample() == pytest.approx(2.0)


def test_a_short_window_keeps_the_last_answer():
    fake = Fake()
    room = _room(fake)
    fake.t, fake.own = 1.0, 1.0
    assert room.sample() == pytest.approx(1.0)
    fake.t, fake.idle = 1.0 + MIN_WINDOW_S / 2, 5.0
    assert room.sample() == pytest.approx(1.0)


def test_unknown_idle_time_is_none():
    fake = Fake()
    room = CpuRoom([0], clock=lambda: fake.t, idle=lambda: None, own=lambda: fake.own)
    fake.t = 1.0
    assert room.sample() is None


def test_the_real_machine_answers_a_plausible_room():
    room = CpuRoom([0])
    import time
    time.sleep(MIN_WINDOW_S * 1.2)  # a real window of real counters: the one reading that needs a clock
    assert room.sample() >= 0.0  # Linux: /proc/stat is there
