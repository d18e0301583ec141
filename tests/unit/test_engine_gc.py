"""The engine raises the cyclic GC's first threshold (a step's short-lived objects made CPython's default
of 700 allocations collect several times a step: 22 % of the engine's time at 256 sequences)."""
from __future__ import annotations

import gc

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.llm_engine import LLMEngine
from cllm.gc_freeze import GC_GEN0_THRESHOLD


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


def test_the_api_process_of_an_engine_core_raises_it_too(gc_threshold):
    """ProcessEngine: the server's event loop churns a request's and an output's objects as a step does."""
    import functools

    from cllm.engine.process_engine import ProcessEngine

    gc.set_threshold(700, 11, 12)
    engine = ProcessEngine(load_config(None, environ={}, n_seq_max=4, engine_process="on", log_level="warning"),
                           functools.partial(NullBackend, slots=4))
    try:
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 11, 12)
    finally:
        import asyncio

        asyncio.run(engine.shutdown())
