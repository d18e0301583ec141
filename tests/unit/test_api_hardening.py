"""Issue 9 defects 2, 3 and 6 (negative seed) on the fake backend."""
from __future__ import annotations

import pytest

import cllm
from cllm.engine.llm_engine import LLMEngine
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import FakeBackend, fake_config

GREEDY = SamplingParams(max_tokens=3, temperature=0)


def fake_llm(**overrides) -> cllm.LLM:
    config = fake_config(**overrides)
    return cllm.LLM(backend=FakeBackend(slots=4), config=config)


def test_generate_feeds_a_batch_larger_than_the_waiting_queue():
    llm = fake_llm(max_waiting=8)
    outs = llm.generate([[i % 50] for i in range(100)], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [[(i % 50 + k) % 64 for k in (1, 2, 3)] for i in range(100)]
    assert not llm.engine.has_unfinished()


def test_invalid_prompt_leaves_nothing_queued():
    llm = fake_llm()
    bad = SamplingParams(max_tokens=3, logit_bias={10_000: 1.0})  # token id beyond the vocab
    with pytest.raises(ValueError):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY, bad])
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.num_waiting == 0
    assert llm.generate([[5]], GREEDY)[0].outputs[0].token_ids == [6, 7, 8]  # nothing left over runs here


def test_request_id_clashing_with_a_child_id_is_refused():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    engine.add_request([1], SamplingParams(max_tokens=2, n=2, temperature=0), request_id="x")
    with pytest.raises(ValueError, match="x#0"):
        engine.add_request([1], GREEDY, request_id="x#0")
    engine.add_request([1], GREEDY, request_id="y#1")
    with pytest.raises(ValueError, match="y#1"):
        engine.add_request([1], SamplingParams(max_tokens=2, n=2, temperature=0), request_id="y")
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()  # no zombie group keeps the loop busy


def test_negative_int64_seed_is_accepted_and_reproducible():
    llm = fake_llm()
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=-(2 ** 63))
    first = llm.generate([[1]], p)[0].outputs[0].token_ids
    assert llm.generate([[1]], p)[0].outputs[0].token_ids == first and len(first) == 4


# ---- defect 7: stop strings --------------------------------------------------------------
# The fake model counts: after token t comes t + 1; token i < 26 decodes to chr(0x61 + i).

def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final.outputs[0]


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    out = run_one(engine, [0], SamplingParams(max_tokens=3, temperature=0, stop=["cd"]))  # b c d
    assert out.finish_reason == "stop" and out.stop_reason == "cd" and out.text == "b"


def test_min_tokens_holds_stop_strings_back():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    out = run_one(engine, [0], SamplingParams(max_tokens=10, temperature=0, stop=["c"], min_tokens=4))
    assert out.token_ids[:4] == [1, 2, 3, 4] and "c" in out.text  # "c" at token 2 did not stop it
    assert out.finish_reason == "length"


def test_stop_reason_is_null_for_eos_and_the_id_for_a_stop_token():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    eos = run_one(engine, [61], SamplingParams(max_tokens=5, temperature=0))  # 62, then EOS 63
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    tok = run_one(engine, [0], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[2]))
    assert tok.finish_reason == "stop" and tok.stop_reason == 2


def test_stop_strings_are_capped_in_length():
    engine = LLMEngine(fake_config(max_stop_string_chars=8), FakeBackend(slots=4))
    with pytest.raises(ValueError, match="max_stop_string_chars"):
        engine.add_request([0], SamplingParams(max_tokens=3, stop=["x" * 9]))
    assert not engine.has_unfinished()
