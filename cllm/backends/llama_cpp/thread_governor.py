"""ThreadGovernor: fewer llama.cpp threads while other processes take the CPU, all of them again when they stop.

ggml's worker threads spin-wait for each other at every graph node, so when the
OS gives one of them's core to another process, every thread waits for it and the
whole step stalls: on a 2-core machine beside two busy processes, a 64-token
request took 11.8-25.9 s with 2 threads and 0.88 s with 1. The best count depends
on a load that comes and goes, so it is measured at run time, step by step:

- Each step's time is kept per thread count and per class of work (tokens in the
  batch, context length; ``work_class``): the fastest seen is what that work costs
  at that count on a quiet machine (``floor``), a moving average what it costs now
  (``recent``). A count first seen under contention takes its quiet cost from a
  higher count's floor, scaled linearly.
- ``patience`` steps in a row slower than ``slow_factor`` x their floor: one thread
  fewer (the contention the issue measured makes steps 13-25x slower).
- At a reduced count, every ``probe_every`` steps one step runs at one thread more;
  when it takes at most ``win_ratio`` of what the same work costs now at the
  current count, the governor goes back up. A lost probe doubles the interval (up
  to ``probe_every_max``), so a machine that stays busy pays one slow step in
  hundreds; going down again soon after going up counts as a lost probe
  (hysteresis: contention that comes and goes does not make it flap).
- A machine busy from the start gives no quiet floor to compare with, so every
  ``explore_every`` steps (doubling on each loss) one step also tries one thread
  fewer, with the same rule.
- The CPU room (cpu_room.py: the CPUs this process could have used lately, its own
  time plus its CPUs' idle time) calls for those probes early: a CPU free for one
  thread more, or fewer CPUs than threads, and the probe runs within
  ``room_probe_every`` steps (doubling on each loss, so a room that misleads, as
  under a cgroup quota, costs no more than the step-count probes). So the count
  comes back up within a few steps of the contention ending, while the step-count
  probes, no longer needed for that, stay rare.

Plain Python over observed durations, no clock of its own: tests feed step times.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Contexts are classed in powers of two of this many tokens (attention's share of a step grows with them).
_CONTEXT_QUANTUM = 512


def work_class(n_tokens: int, max_position: int) -> tuple[int, int]:
    """Steps whose cost is comparable: tokens in the batch to half a power of two (a prefill chunk's time grows
    with its tokens: within a class at most 1.5x, below ``slow_factor``), context length to a power of two."""
    n = max(1, n_tokens)
    octave = n.bit_length()
    half = 1 if octave >= 2 and n >= 3 << (octave - 2) else 0
    return (2 * octave + half, (max(0, max_position) // _CONTEXT_QUANTUM).bit_length())


@dataclass(slots=True)
class GovernorSettings:
    """How eagerly the governor reacts (defaults: see the module docstring)."""

    slow_factor: float = 2.0  # a step this many times its floor is slow
    patience: int = 3  # slow steps in a row before one thread fewer
    win_ratio: float = 0.85  # a probe wins at most this fraction of the current count's recent time
    probe_every: int = 32  # steps at a reduced count between probes of one thread more
    probe_every_max: int = 1024  # the longest interval lost probes grow to
    explore_every: int = 256  # steps between tries of one thread fewer with no slowdown seen
    explore_every_max: int = 8192
    ewma: float = 0.3  # weight of the newest step in ``recent``
    room_probe_every: int = 4  # fewest steps between probes that the CPU room (cpu_room.py) calls for
    room_up: float = 0.75  # room >= current + this: a thread more may have a CPU to run on
    room_down: float = 0.5  # room <= current - this: some of our threads have none


@dataclass(slots=True)
class _Cost:
    floor: float  # fastest step seen of this work at this count (s)
    recent: float  # moving average of the same (s)


@dataclass(slots=True)
class ThreadGovernor:
    """Chooses the thread count of each llama_decode between 1 and ``top``.

    Call ``threads_for_step()`` before a step and ``observe(work, seconds)`` after it.
    """

    top: int  # the most threads (the configured or default count)
    settings: GovernorSettings = field(default_factory=GovernorSettings)
    current: int = 0  # the count steps run with (0: top, set in __post_init__)
    changes: int = 0  # times ``current`` changed
    lowered: int = 0  # of those, times it went down
    reason: str = "start"  # why ``current`` is what it is (for /v1/engine)
    _costs: dict[tuple[int, int], dict[int, _Cost]] = field(default_factory=dict)  # work -> threads -> cost
    _slow_run: int = 0  # slow steps in a row at ``current``
    _since_up: int = 0  # steps since the last probe of current+1 (or since going down)
    _since_down: int = 0  # steps since the last try of current-1
    _up_every: int = 0
    _down_every: int = 0
    _steps_at_current: int = 0
    _probe: int | None = None  # the count the next step runs with, when it is a probe
    _probe_by_room: bool = False  # that probe was called for by the CPU room, not by the step count
    _room_up_every: int = 0
    _room_down_every: int = 0

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError(f"ThreadGovernor top={self.top}: needs at least 1 thread")
        self.current = self.current or self.top
        self._up_every = self.settings.probe_every
        self._down_every = self.settings.explore_every
        self._room_up_every = self._room_down_every = self.settings.room_probe_every

    def threads_for_step(self, room: float | None = None) -> int:
        """The thread count the next step should run with (a probe's, once in a while). ``room``: the CPUs
        this process could have used lately (CpuRoom), None if unknown; it calls for probes early."""
        if self._probe is None:
            s = self.settings
            up_room = room is not None and room >= self.current + s.room_up
            down_room = room is not None and room <= self.current - s.room_down
            if self.current < self.top and self._since_up >= self._up_every:
                self._probe, self._probe_by_room = self.current + 1, False
            elif self.current < self.top and up_room and self._since_up >= self._room_up_every:
                self._probe, self._probe_by_room = self.current + 1, True
            elif self.current > 1 and self._since_down >= self._down_every:
                self._probe, self._probe_by_room = self.current - 1, False
            elif self.current > 1 and down_room and self._since_down >= self._room_down_every:
                self._probe, self._probe_by_room = self.current - 1, True
        return self._probe if self._probe is not None else self.current

    def observe(self, work: tuple[int, int], seconds: float) -> None:
        """Record a step of ``work`` that took ``seconds`` at the count ``threads_for_step`` returned."""
        if seconds <= 0:
            return
        threads, self._probe = (self._probe, None) if self._probe is not None else (self.current, None)
        known = self._costs.get(work, {}).get(self.current)
        self._record(threads, work, seconds)
        if threads != self.current:
            self._judge_probe(threads, known, seconds)
            return
        self._since_up += 1
        self._since_down += 1
        self._steps_at_current += 1
        slow = seconds > self.settings.slow_factor * self._expected(threads, work)
        self._slow_run = self._slow_run + 1 if slow else 0
        if self._slow_run >= self.settings.patience and self.current > 1:
            # going down again soon after a probe took us up: that probe was a lucky step
            s = self.settings
            quick = self._steps_at_current < self._up_every
            self._up_every = min(s.probe_every_max, self._up_every * 2) if quick else s.probe_every
            self._move(self.current - 1, f"{self._slow_run} steps slower than {s.slow_factor:g}x "
                                         f"their quiet time at {self.current} threads")

    def _expected(self, threads: int, work: tuple[int, int]) -> float:
        """What ``work`` costs at ``threads`` on a quiet machine: its own floor, or, where this count was
        first measured under contention, a higher count's floor scaled as if threads sped it up linearly
        (an over-estimate of the cost with fewer threads, so it errs towards calling a step not slow)."""
        return min(cost.floor * u / threads for u, cost in self._costs[work].items() if u >= threads)

    def _record(self, threads: int, work: tuple[int, int], seconds: float) -> None:
        by_threads = self._costs.setdefault(work, {})
        cost = by_threads.get(threads)
        if cost is None:
            by_threads[threads] = _Cost(floor=seconds, recent=seconds)
            return
        cost.floor = min(cost.floor, seconds)
        cost.recent += self.settings.ewma * (seconds - cost.recent)

    def _judge_probe(self, threads: int, known: _Cost | None, seconds: float) -> None:
        """A probe step at ``threads`` took ``seconds``: move there if it beat the current count's recent time."""
        up = threads > self.current
        if known is not None and seconds <= self.settings.win_ratio * known.recent:
            self._move(threads, f"a step at {threads} threads took {seconds / known.recent:.2f}x "
                                f"the time at {self.current}")
            return
        s = self.settings
        if known is None:  # no comparison yet: not a loss
            pass
        elif up and self._probe_by_room:
            self._room_up_every = min(s.probe_every_max, self._room_up_every * 2)
        elif up:
            self._up_every = min(s.probe_every_max, self._up_every * 2)
        elif self._probe_by_room:
            self._room_down_every = min(s.explore_every_max, self._room_down_every * 2)
        else:
            self._down_every = min(s.explore_every_max, self._down_every * 2)
        if up:
            self._since_up = 0
        else:
            self._since_down = 0

    def _move(self, threads: int, reason: str) -> None:
        self.lowered += threads < self.current
        self.current = threads
        self.changes += 1
        self.reason = reason
        self._slow_run = 0
        self._since_up = 0
        self._since_down = 0
        self._steps_at_current = 0
        self._down_every = self.settings.explore_every
        self._room_up_every = self._room_down_every = self.settings.room_probe_every
