"""Progress for the slow steps a person waits through: one helper, ``phase``, for all of them.

    with phase("converting weights to q8_0", estimate_s=1.5):
        convert(...)                                    # a step with no progress of its own

    with phase("capturing CUDA graphs", total=len(buckets), unit="graph", estimate_s=20) as p:
        for b in buckets:
            capture(b)
            p.advance()                                 # a step that can count its parts

It writes a start line that says what is happening and about how long it takes, and an end line with
the time it took. On a terminal a tqdm bar runs in between: over the parts when ``total`` is given
(or ``update(fraction)`` is called), else over the seconds of the estimate (it stops at 99 % when the
estimate runs out, and the end line tells the truth). Into a log file or a pipe only the two lines
go, so logs stay readable. ``CLLM_PROGRESS=0`` silences both; ``CLLM_PROGRESS=1`` forces the bar.
Steps quicker than ``min_s`` (estimate and actual) print nothing at all.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

_TICK_S = 0.2  # how often a time-driven bar redraws
# Phases running now, outermost first. A terminal holds one bar well: a phase that starts inside another
# (weight conversion inside model load) takes the bar, and the outer one goes on with its end line only.
_RUNNING: list[Phase] = []
_RUNNING_LOCK = threading.Lock()


def format_duration(seconds: float) -> str:
    """3.2 -> '3.2 s', 95 -> '1 min 35 s', 4000 -> '1 h 7 min'."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _mode(stream: TextIO) -> str:
    """'off', 'bar' or 'lines' for this stream and the environment."""
    env = os.environ.get("CLLM_PROGRESS", "").strip().lower()
    if env in ("0", "off", "false", "no"):
        return "off"
    if env in ("1", "on", "true", "yes", "bar"):
        return "bar"
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


class Phase:
    """A running slow step (made by ``phase``): report parts done or a fraction, or nothing at all."""

    def __init__(self, what: str, *, total: int | None, unit: str, estimate_s: float | None,
                 stream: TextIO, mode: str) -> None:
        self.what = what  # what is happening, lower-case, no full stop
        self.total = total  # parts to do, when the step can count them
        self.unit = unit  # what a part is called
        self.estimate_s = estimate_s  # how long it should take, when known
        self.done: float = 0  # parts done (total given), percent (update) or seconds elapsed (time-driven)
        self._stream = stream
        self._mode = mode
        self._counted = total is not None  # a counted bar is not driven by the clock
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()
        self.started = time.perf_counter()

    # ------------------------------------------------------------ for the caller
    def advance(self, parts: float = 1) -> None:
        """``parts`` more of ``total`` are done."""
        with self._lock:
            self.done += parts
            self._redraw()

    def update(self, fraction: float) -> None:
        """The step knows how far it is (0..1): the bar follows that, not the clock."""
        with self._lock:
            if not self._counted:
                self._counted, self.total, self.unit = True, 100, "%"
                if self._bar is not None:  # from a bar over the estimate's seconds to one over percent
                    self._bar.close()
                    self._bar = self._open_bar()
            self.done = round(max(0.0, min(1.0, fraction)) * 100)
            self._redraw()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    # ------------------------------------------------------------- internals
    def _redraw(self) -> None:
        if self._bar is None:
            return
        self._bar.n = min(self.done, self._bar.total or self.done)
        self._bar.refresh()

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            with self._lock:
                if not self._counted and self.estimate_s:
                    self.done = min(self.elapsed_s, 0.99 * self.estimate_s)
                    self._redraw()

    def _suspend(self) -> None:
        """Give the terminal's bar to a phase nested in this one; this one keeps only its end line."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _start(self) -> None:
        with _RUNNING_LOCK:
            for outer in _RUNNING:
                outer._suspend()
            _RUNNING.append(self)
        about = f" (about {format_duration(self.estimate_s)})" if self.estimate_s else ""
        self._stream.write(f"cllm: {self.what}{about} ...\n")
        self._stream.flush()
        if self._mode != "bar":
            return
        self._bar = self._open_bar()
        if not self._counted:
            self._ticker = threading.Thread(target=self._tick, name="cllm-progress", daemon=True)
            self._ticker.start()

    def _open_bar(self) -> tqdm:
        about = format_duration(self.estimate_s or 0)
        if self.unit == "%":  # update(fraction): percent done, and what is left at this pace
            fmt = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}, about {remaining} left"
        elif self._counted:
            fmt = None  # tqdm's own: n/total, rate, remaining
        else:
            fmt = "{desc}: {percentage:3.0f}%|{bar}| {elapsed} of about " + about
        return tqdm(total=self.total if self._counted else (self.estimate_s or 1.0), unit=self.unit,
                    file=self._stream, leave=False, dynamic_ncols=True, desc=self.what, bar_format=fmt)

    def _finish(self, failed: bool) -> None:
        self._suspend()
        with _RUNNING_LOCK:
            if self in _RUNNING:
                _RUNNING.remove(self)
        outcome = "failed after" if failed else "done in"
        self._stream.write(f"cllm: {self.what}: {outcome} {format_duration(self.elapsed_s)}\n")
        self._stream.flush()


@contextmanager
def phase(what: str, *, estimate_s: float | None = None, total: int | None = None, unit: str = "it",
          stream: TextIO | None = None, min_s: float = 0.0) -> Iterator[Phase]:
    """Tell the person that ``what`` is happening, how long it should take, and when it is done.

    ``estimate_s``: the expected duration (said in the start line; drives the bar when there are no
    parts to count). ``total``/``unit``: the step's countable parts (``Phase.advance``). ``min_s``:
    say nothing for a step expected to take less than this (its end line still comes if it then takes
    longer). Exceptions pass through, after an end line that says it failed.
    """
    out = stream if stream is not None else sys.stderr
    mode = _mode(out)
    progress = Phase(what, total=total, unit=unit, estimate_s=estimate_s, stream=out, mode=mode)
    quiet_start = mode == "off" or (estimate_s is not None and estimate_s < min_s)
    if not quiet_start:
        progress._start()
    try:
        yield progress
    except BaseException:
        if mode == "off":
            raise
        if quiet_start:
            _late_line(progress, out, failed=True)
        else:
            progress._finish(failed=True)
        raise
    if mode == "off":
        return
    if not quiet_start:
        progress._finish(failed=False)
    elif progress.elapsed_s >= max(min_s, 1.0):
        _late_line(progress, out, failed=False)


def _late_line(progress: Phase, out: TextIO, *, failed: bool) -> None:
    """The end line of a step that was expected to be quick and said nothing at the start."""
    outcome = "failed after" if failed else "took"
    out.write(f"cllm: {progress.what}: {outcome} {format_duration(progress.elapsed_s)}\n")
    out.flush()


# Model load pace for the estimate, measured on the 2-core CPU machines with the embedded 98 MB GGUF:
# llama.cpp maps the file and sets up its context in well under a second; torch dequantizes a GGUF or reads
# safetensors and builds its model, several times slower per byte.
_LOAD_BASE_S = {"llama_cpp": 1.5, "torch": 3.0}  # llama_cpp: context set-up, 64 slots of KV included
_LOAD_BYTES_PER_S = {"llama_cpp": 400e6, "torch": 40e6}


def _model_bytes(path: Any) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) or sum(
            f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size


def model_load_phase(config: Any) -> Any:
    """``phase`` for building an engine from ``config`` (a CllmConfig): what loads, on what, how long."""
    from cllm.model_path import resolve_model_path

    backend = config.model.backend
    try:
        path = resolve_model_path(config.model.model)
        size, name = _model_bytes(path), path.name
    except OSError:  # a missing model fails inside the load, with its own message
        size, name = 0, str(config.model.model)
    estimate = _LOAD_BASE_S.get(backend, 3.0) + size / _LOAD_BYTES_PER_S.get(backend, 40e6)
    return phase(f"loading {name} ({size / 1e6:.0f} MB) on the {backend} backend", estimate_s=estimate)
