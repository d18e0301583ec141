"""Constrained decoding through the engine on the fake backend (a counting "model" whose favourite
next token is never what the grammar wants): the mask decides, matchers follow preemption and
abort, grammars compile once, bad ones are ValueErrors naming the field."""
from __future__ import annotations

import re

import pytest

from cllm.engine.llm import LLM
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import FakeBackend, fake_config


def make_llm(**backend_kwargs) -> LLM:
    return LLM(backend=FakeBackend(**backend_kwargs), config=fake_config())


def test_choice_is_followed_against_the_models_preference():
    llm = make_llm()
    # The counting model wants "b" after "a"; only "cab" / "zebra" are allowed.
    out = llm.generate("a", SamplingParams(max_tokens=20, temperature=0, choice=["zebra", "cab"]))[0]
    assert out.outputs[0].text == "cab" and out.outputs[0].finish_reason == "stop"


def test_regex_with_sampling_n_choices_and_unconstrained_batch_mates():
    llm = make_llm()
    regex = SamplingParams(max_tokens=30, temperature=1.5, seed=3, n=4, regex="x(ab|cd){1,5}y")
    free = SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(["a", "c", "e"], [regex, free, regex])
    for out in (outs[0], outs[2]):
        for choice in out.outputs:
            assert re.fullmatch("x(ab|cd){1,5}y", choice.text), choice.text
            assert choice.finish_reason == "stop"
    assert outs[1].outputs[0].text == "defgh"  # the unconstrained neighbour is untouched
    assert llm.engine.structured._tracked == {}  # every matcher given back


def test_matcher_follows_tokens_kept_across_preemption():
    # KV for ~1.5 sequences: the scheduler keeps preempting (recompute) while both grow.
    llm = make_llm(slots=2, kv_tokens=40)
    params = SamplingParams(max_tokens=24, temperature=0, regex="q[a-z]{10,20}z")
    outs = llm.generate(["abcd", "efgh"], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert re.fullmatch("q[a-z]{10,20}z", out.outputs[0].text), out.outputs[0].text


def test_grammar_ends_the_request_despite_min_tokens():
    llm = make_llm()
    out = llm.generate("a", SamplingParams(max_tokens=20, temperature=0, min_tokens=10, grammar='root ::= "ok"'))[0]
    assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"


def test_compiled_once_per_key_and_abort_frees_the_matcher():
    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0, choice=["abc"])
    rid = engine.add_request("a", params)
    engine.step()
    assert engine.structured.is_constrained(rid)
    engine.abort_request(rid)
    assert not engine.structured.is_constrained(rid)
    llm.generate(["a", "b"], SamplingParams(max_tokens=5, temperature=0, choice=["abc"]))
    assert engine.structured.cache.misses == 1 and engine.structured.cache.hits >= 3


@pytest.mark.parametrize("params, name", [
    (dict(grammar="root ::= foo"), "grammar"),
    (dict(regex="[a-"), "regex"),
    (dict(json_schema={"type": "strin"}), "json_schema"),
])
def test_uncompilable_constraint_is_a_value_error_naming_it(params, name):
    llm = make_llm()
    with pytest.raises(ValueError, match=rf"invalid {name}=.*does not compile"):
        llm.generate("a", SamplingParams(max_tokens=5, **params))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    (dict(regex="a", choice=["a"]), "only one of"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(choice=[]), "invalid choice"),
    (dict(grammar="  "), "invalid grammar"),
])
def test_bad_constraint_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_constraint_key_canonical():
    a = SamplingParams(json_schema={"b": 1, "a": {"type": "string"}})
    b = SamplingParams(json_schema='{"b": 1,  "a": {"type":"string"}}')
    assert a.constraint_key == b.constraint_key and SamplingParams().constraint_key is None
    assert '"b"' in a.constraint_key[1].split('"a"')[0]  # property order kept: it is the generation order


def test_a_failing_batch_mate_leaves_the_constrained_rows_right():
    backend = FakeBackend()
    llm = LLM(backend=backend, config=fake_config())
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, regex="z[a-c]{3}z")
    good = engine.add_request("a", params, request_id="good")
    engine.add_request("b", params, request_id="bad")
    backend.fail_when = {"bad"}  # the batch fails; rerun one by one, only "bad" fails
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert re.fullmatch("z[a-c]{3}z", finals[good].outputs[0].text)
    assert engine.structured._tracked == {}


def test_mask_applies_to_numpy_and_torch_logits_alike():
    import numpy as np
    import torch

    from cllm.request import Request
    from cllm.structured import StructuredOutputs
    from tests.unit.fakes import ByteTokenizer

    tok = ByteTokenizer()
    structured = StructuredOutputs(tok, cache_size=4)
    req = Request("r", [0], SamplingParams(choice=["cab", "dog"]), max_tokens=5)
    structured.compile(req.params)
    structured.add(req)
    base = np.random.default_rng(0).normal(size=(3, tok.vocab_size + 5)).astype(np.float32)  # padded logits
    as_numpy, as_torch = base.copy(), torch.from_numpy(base.copy())
    for logits in (as_numpy, as_torch):
        structured.apply(logits, ["x", "r", "y"], structured.start_fill([req]))
    assert np.array_equal(as_numpy, as_torch.numpy())
    assert list(np.flatnonzero(np.isfinite(as_numpy[1]))) == [2, 3, 28, 29, 54, 55]  # the tokens spelling "c" or "d"
    assert np.array_equal(as_numpy[[0, 2]], base[[0, 2]])  # unconstrained rows untouched
    structured.close()


def test_both_samplers_end_a_grammar_that_allows_only_eos_despite_min_tokens():
    import numpy as np
    import torch

    from cllm.sampling import torch_sampler
    from cllm.sampling.sampler import SamplingRow, sample

    vocab, eos = 64, 63
    logits = np.full((2, vocab), -np.inf, dtype=np.float32)
    logits[0, eos] = 1.0  # row 0: the grammar allows only EOS
    logits[1, [5, eos]] = [2.0, 1.0]  # row 1: EOS and one other token
    params = SamplingParams(min_tokens=5, logprobs=3, temperature=0)
    rows = [SamplingRow(params, np.random.default_rng(0), [1], [], frozenset({eos})) for _ in range(2)]
    for result in (sample(logits.copy(), rows), torch_sampler.sample(torch.from_numpy(logits.copy()), rows)):
        assert [r.token_id for r in result] == [eos, 5]  # EOS is held back only where something else is allowed
        assert result[0].top_ids == [eos] and result[1].top_ids == [5]  # no -inf alternatives
        assert all(np.isfinite(r.logprob) for r in result)


def test_a_token_the_grammar_refuses_fails_only_that_request():
    # Never expected (the mask allows only what the matcher accepts), but e.g. a hand-off from an
    # engine with another vocabulary could replay such tokens: that request fails, the engine lives.
    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, choice=["cab"])
    bad = engine.add_request("a", params, request_id="bad")
    good = engine.add_request("b", params, request_id="good")
    engine.step()
    engine.scheduler.requests[bad].output_token_ids.append(25)  # "z": no sentence of the grammar has it
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[bad].outputs[0].finish_reason == "error" and "refused token 25" in finals[bad].error
    assert finals[good].outputs[0].text == "cab" and finals[good].outputs[0].finish_reason == "stop"
