"""cllm.progress: the start and end lines, the bar on a terminal, nesting, silence, and the serve ready block."""
from __future__ import annotations

import io
import re
import threading

import pytest

from cllm.config import CllmConfig
from cllm.progress import Phase, format_duration, model_load_phase, phase
from cllm.server.ready import base_url, curl_line, ready_lines


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_in_a_log(monkeypatch):
    monkeypatch.delenv("CLLM_PROGRESS", raising=False)
    out = io.StringIO()
    with phase("converting weights", estimate_s=95, stream=out):
        pass
    lines = out.getvalue().splitlines()
    assert lines == ["cllm: converting weights (about 1 min 35 s) ...", lines[1]]
    assert lines[1].startswith("cllm: converting weights: done in 0.0 s")
    assert "\r" not in out.getvalue()  # no bar in a file


def test_failure_is_said_and_raised(monkeypatch):
    monkeypatch.delenv("CLLM_PROGRESS", raising=False)
    out = io.StringIO()
    with pytest.raises(RuntimeError), phase("building", estimate_s=1, stream=out):
        raise RuntimeError("boom")
    assert "cllm: building: failed after" in out.getvalue()


def test_bar_on_a_terminal_counts_parts_and_time(monkeypatch):
    monkeypatch.delenv("CLLM_PROGRESS", raising=False)
    out = _Tty()
    with phase("capturing graphs", total=4, unit="graph", stream=out) as p:
        for _ in range(4):
            p.advance()
    assert "4/4" in out.getvalue() and "graph" in out.getvalue()
    out = _Tty()
    moved = threading.Event()
    redraw = Phase._redraw

    def redrawing(self: Phase) -> None:
        redraw(self)
        if not self._counted and self.done > 0:
            moved.set()  # the ticker redrew the bar with the time elapsed
    monkeypatch.setattr(Phase, "_redraw", redrawing)
    with phase("loading", estimate_s=0.6, stream=out):
        assert moved.wait(30), "the bar never moved with the clock"
    assert "of about 0.6 s" in out.getvalue()
    assert re.search(r" [1-9]\d?%\|", out.getvalue()), out.getvalue()  # between 1 and 99 %: time has counted
    out = _Tty()
    with phase("compiling", estimate_s=100, stream=out) as p:
        p.update(0.42)
    assert "42%|" in out.getvalue() and "left" in out.getvalue()


def test_nested_phase_takes_the_bar(monkeypatch):
    monkeypatch.delenv("CLLM_PROGRESS", raising=False)
    out = _Tty()
    with phase("outer", estimate_s=5, stream=out) as outer, phase("inner", estimate_s=5, stream=out):
        assert outer._bar is None  # the outer one gave its bar up
    assert out.getvalue().count("cllm: outer: done in") == 1


def test_silence_and_quick_steps(monkeypatch):
    monkeypatch.setenv("CLLM_PROGRESS", "0")
    out = io.StringIO()
    with phase("anything", estimate_s=10, stream=out):
        pass
    assert out.getvalue() == ""
    monkeypatch.delenv("CLLM_PROGRESS")
    with phase("quick", estimate_s=0.1, min_s=1.0, stream=out):
        pass
    assert out.getvalue() == ""


def test_format_duration():
    assert [format_duration(s) for s in (0.25, 12.4, 60, 3725)] == ["0.2 s", "12 s", "1 min", "1 h 2 min"]


def test_model_load_phase_names_the_model_and_backend(capsys, monkeypatch):
    monkeypatch.delenv("CLLM_PROGRESS", raising=False)
    with model_load_phase(CllmConfig()):
        pass
    err = capsys.readouterr().err
    assert "loading SmolLM2-135M-Instruct.Q4_1.gguf (98 MB) on the llama_cpp backend (about" in err


def test_ready_block():
    config = CllmConfig.model_validate({"server": {"host": "0.0.0.0", "port": 9000, "api_key": "s3cret"}})
    assert base_url(config) == "http://127.0.0.1:9000"
    lines = ready_lines(config, engine=object(), model="m", max_model_len=2048)
    text = "\n".join(lines)
    assert "chat page : http://127.0.0.1:9000/" in text
    assert "API base  : http://127.0.0.1:9000/v1" in text and "API key required" in text
    assert "s3cret" not in text  # the key is never printed
    assert '$CLLM_API_KEY' in curl_line(config, "m")
    assert "2048 tokens" in text
