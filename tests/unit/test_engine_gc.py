"""The engine raises the cyclic GC's first threshold (a step's short-lived objects made CPython's default
of 700 allocations collect several times a step: 22 % of the engine's time at 256 sequences)."""
from __future__ import annotations

import gc

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.llm_engine import GC_GEN0_THRESHOLD, LLMEngine


@pytest.fixture()
def gc_threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def _engine() -> LLMEngine:
    return LLMEngine(load_config(None, environ={}, n_seq_max=4), backend=NullBackend(slots=4))


def test_engine_raises_a_low_first_threshold_and_keeps_the_others(gc_threshold):
    gc.set_threshold(700, 11, 12)
    _engine().close()
    assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 11, 12)


@pytest.mark.parametrize("threshold", [(50_000, 10, 10), (0, 10, 10)])
def test_engine_never_lowers_the_threshold_nor_turns_collection_on(gc_threshold, threshold):
    gc.set_threshold(*threshold)
    _engine().close()
    assert gc.get_threshold() == threshold
