"""The thread governor on the real model: scripted step times change the context's real thread count."""
from __future__ import annotations

import llama_cpp as C
import pytest

import cllm
import cllm.backends.llama_cpp.backend as backend_module

QUIET = {2: 0.010, 1: 0.018}
BUSY = {2: 0.250, 1: 0.019}


class ScriptedClock:
    """perf_counter for the backend's step timing: each decode takes what ``times`` says for its thread count."""

    def __init__(self, backend) -> None:
        self.backend, self.times, self.now, self.calls = backend, QUIET, 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a decode: its scripted duration has passed
            self.now += self.times[self.backend.compute_threads]
        return self.now


@pytest.fixture()
def llm(monkeypatch):
    monkeypatch.setattr(backend_module, "default_n_threads", lambda: 2)  # 2 threads whatever this machine has
    with cllm.LLM(n_seq_max=2) as llm:
        yield llm


def _generate(llm, tokens: int) -> None:
    out = llm.generate(["Once upon a time"], cllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == tokens


def test_contention_lowers_the_contexts_threads_and_quiet_brings_them_back(llm):
    backend = llm.engine.backend
    ctx = backend._ctx.ptr
    clock = backend._step_clock = ScriptedClock(backend)
    backend._cpu_room = None  # step times alone (the room's early probes: the next test)
    assert backend.thread_governor is not None and C.llama_n_threads(ctx) == 2
    _generate(llm, 12)
    assert C.llama_n_threads(ctx) == 2 and llm.stats().compute_threads == 2
    clock.times = BUSY
    _generate(llm, 12)
    assert backend.thread_governor.current == 1
    assert C.llama_n_threads(ctx) == 1 and C.llama_n_threads_batch(ctx) == 1
    stats = llm.stats()
    assert stats.compute_threads == 1 and stats.compute_threads_lowered == 1
    backend.embed([[1, 2, 3]])  # embeddings run with the same, lowered count
    assert C.llama_n_threads(backend._embedder._ctx.ptr) == 1
    clock.times = QUIET
    _generate(llm, 100)  # the next probe of 2 threads (after 32 or 64 steps) wins
    assert backend.thread_governor.current == 2 and C.llama_n_threads(ctx) == 2
    assert llm.stats().compute_threads_lowered == 1


class ScriptedRoom:
    def __init__(self) -> None:
        self.room = 2.0

    def sample(self) -> float:
        return self.room


def test_the_cpu_room_brings_the_threads_back_within_a_few_steps(llm):
    backend = llm.engine.backend
    clock = backend._step_clock = ScriptedClock(backend)
    room = backend._cpu_room = ScriptedRoom()
    backend._cores_per_cpu = 1.0
    _generate(llm, 12)
    clock.times, room.room = BUSY, 1.1  # a competitor: two threads of ours share one CPU
    _generate(llm, 12)
    assert C.llama_n_threads(backend._ctx.ptr) == 1
    clock.times, room.room = QUIET, 2.0  # it stops
    _generate(llm, 8)
    assert C.llama_n_threads(backend._ctx.ptr) == 2 and backend.thread_governor.current == 2


@pytest.mark.parametrize("settings", [{"n_threads": 2}, {"adapt_threads": "off"}])
def test_a_chosen_thread_count_or_adapt_off_is_kept(monkeypatch, settings):
    monkeypatch.setattr(backend_module, "default_n_threads", lambda: 2)
    with cllm.LLM(n_seq_max=2, **settings) as llm:
        backend = llm.engine.backend
        assert backend.thread_governor is None
        backend._step_clock = ScriptedClock(backend)
        backend._step_clock.times = BUSY
        _generate(llm, 12)
        assert C.llama_n_threads(backend._ctx.ptr) == 2 and llm.stats().compute_threads == 2
