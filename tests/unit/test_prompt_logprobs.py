"""Prompt logprobs and max_tokens=0 in the engine, on the counting fake backend (no model).

The fake model puts logit 10 on (t + 1) % vocab after token t and 0 elsewhere,
so a prompt token that follows its predecessor by one has logprob
10 - log(e^10 + 63) and any other token 0 - log(e^10 + 63): exact values to
check scoring, chunking and ordering against.
"""
from __future__ import annotations

import math

import pytest

from cllm.engine.llm_engine import LLMEngine
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import VOCAB, FakeBackend, fake_config

HIT = 10.0 - math.log(math.exp(10.0) + VOCAB - 1)
MISS = 0.0 - math.log(math.exp(10.0) + VOCAB - 1)
PROMPT = [1, 2, 3, 7, 8, 20, 21, 22, 5, 6, 9, 10]  # successors except after 3, 8, 22 and 6


def expected(prompt: list[int]) -> list[float | None]:
    return [None] + [HIT if b == (a + 1) % VOCAB else MISS for a, b in zip(prompt, prompt[1:])]


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request(prompt, params, request_id="r")
    final = None
    for _ in range(100):
        for out in engine.step():
            final = out
        if not engine.has_unfinished():
            return final
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("budget", [64, 5, 1])
def test_prompt_logprobs_exact_under_chunked_prefill(budget: int) -> None:
    backend = FakeBackend(max_batch_tokens=64)
    engine = LLMEngine(fake_config(n_batch=64, max_num_batched_tokens=budget), backend)
    out = run(engine, PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    for entry, token, want in zip(got[1:], PROMPT[1:], expected(PROMPT)[1:]):
        assert entry.token_id == token and entry.logprob == pytest.approx(want, abs=1e-5)
        assert len(entry.top) == 2 and entry.top[0].logprob == pytest.approx(HIT, abs=1e-5)
    assert out.outputs[0].token_ids == [11, 12]  # generation itself is unchanged
    assert backend.no_reuse == ["r"]  # scoring forbids a prefix-cache hit
    assert budget == 64 or len(backend.batches) > 2  # really chunked


def test_max_tokens_zero_scores_the_prompt_without_sampling() -> None:
    backend = FakeBackend()
    engine = LLMEngine(fake_config(n_batch=64), backend)
    out = run(engine, PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))
    choice = out.outputs[0]
    assert out.finished and choice.token_ids == [] and choice.text == "" and choice.finish_reason == "length"
    assert [e.logprob if e else None for e in out.prompt_logprobs] == pytest.approx(expected(PROMPT), abs=1e-5)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(PROMPT)
    assert backend.held == {} and backend.released == ["r"]  # the slot is given back


def test_only_the_first_choice_scores_and_plain_requests_are_untouched() -> None:
    backend = FakeBackend()
    engine = LLMEngine(fake_config(n_batch=64), backend)
    out = run(engine, PROMPT, SamplingParams(max_tokens=1, temperature=0, n=3, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == len(PROMPT) and backend.no_reuse == ["r#0"]
    plain = run(engine, [4, 5], SamplingParams(max_tokens=1, temperature=0))
    assert plain.prompt_logprobs is None


def test_max_tokens_zero_needs_prompt_logprobs_and_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("steps_before", [1, 3])
def test_hand_off_mid_prefill_keeps_scoring(steps_before: int) -> None:
    """A request handed to another engine part-way through its (chunked) prompt carries the logprobs
    scored so far, and the receiver scores the rest: the result equals scoring in one engine."""
    from cllm.handoff.local import hand_off

    src = LLMEngine(fake_config(n_batch=64, max_num_batched_tokens=5), FakeBackend(max_batch_tokens=64))
    dst = LLMEngine(fake_config(n_batch=64, max_num_batched_tokens=5), FakeBackend(max_batch_tokens=64))
    src.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), request_id="r")
    for _ in range(steps_before):
        src.step()
    hand_off(src, dst, "r", chunk_bytes=64)
    out = None
    while dst.has_unfinished():
        for o in dst.step():
            out = o
    assert [e.logprob if e else None for e in out.prompt_logprobs] == pytest.approx(expected(PROMPT), abs=1e-5)
    assert out.outputs[0].token_ids == [11, 12]


def test_a_scored_prompt_is_evaluated_in_bounded_chunks() -> None:
    """Prompt logprobs need a row of logits per prompt token: at most SCORED_CHUNK_TOKENS of them a step."""
    from cllm.scheduler.scheduler import SCORED_CHUNK_TOKENS
    from tests.unit.fakes import FakeBackend, fake_config, run_all
    import cllm

    backend = FakeBackend(slots=2, max_batch_tokens=4096, kv_tokens=100_000, max_model_len=8192)
    llm = cllm.LLM(backend=backend, config=fake_config())
    prompt = [i % 60 for i in range(1300)]
    llm.engine.add_request(prompt, cllm.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), request_id="s")
    final = run_all(llm.engine)["s"]
    sizes = [len(flat) for flat, _, _ in backend.batches]
    assert max(sizes) <= SCORED_CHUNK_TOKENS and sum(sizes) == 1300 + 0  # the prompt in bounded chunks, no decode step
    assert len(final.prompt_logprobs) == 1300
