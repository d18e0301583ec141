"""The one-step lookahead on the torch backend (CPU, float32, the embedded model dequantised): the code
path a GPU takes (decode steps launched on device-sampled ids, prompt chunks joining them, rows dropped
and confirmed), forced on with ``lookahead: on`` and ``sampler: torch``.

What is guaranteed, and asserted:

- when the lookahead's steps hold the same rows as today's (requests admitted together, same lengths,
  nothing ending early), every computation is the same: tokens and logprobs are bitwise equal, greedy
  and seeded;
- under admissions, stop strings, aborts and preemption the lookahead batches rows differently (a
  prompt chunk joins the next launched step, rows of ended requests are computed and dropped), and a
  row's logits may then differ by float rounding with the batch: greedy tokens are equal up to the first
  near-tie (top two log-probabilities within ``TIE`` in the run without it, where rounding may pick
  either), and log-probabilities agree within ``ATOL`` up to there.

The engine-level guarantee (bitwise, whatever the schedule) is tested over a backend whose logits do
not depend on the batch: tests/unit/test_lookahead.py.
"""
from __future__ import annotations

import pytest

import cllm

ATOL = 1e-4
TIE = 1e-3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
           "1, 2, 3, 4,", "Hello, my name is", "The best way to learn is", "import numpy as np\n"]


def _llm(lookahead: str, **settings: object) -> cllm.LLM:
    return cllm.LLM(backend="torch", dtype="float32", device="cpu", n_threads=2, sampler="torch",
                    lookahead=lookahead, **settings)


def test_the_same_steps_give_bitwise_the_same_outputs():
    greedy = cllm.SamplingParams(max_tokens=16, temperature=0, logprobs=3, ignore_eos=True)
    seeded = cllm.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.2,
                                 logprobs=1, ignore_eos=True)
    runs = {}
    for lookahead in ("off", "on"):
        with _llm(lookahead, n_seq_max=4) as llm:
            ids = [llm.tokenizer.encode(p)[:4] for p in PROMPTS[:4]]  # 4 prompts of 4 tokens, admitted together
            assert all(len(i) == 4 for i in ids)
            runs[lookahead] = [_tokens_and_logprobs(o) for o in llm.generate(ids, greedy) + llm.generate(ids, seeded)]
            assert llm.engine.lookahead is (lookahead == "on")
            if lookahead == "on":
                assert llm.engine.ahead_used == llm.engine.ahead_rows > 0  # every launched row was used
    assert runs["on"] == runs["off"]


def test_admissions_stops_aborts_and_preemption_keep_the_outputs():
    runs = {}
    for lookahead in ("off", "on"):
        with _llm(lookahead, n_seq_max=3, n_ctx=80, block_size=16) as llm:
            engine = llm.engine
            for i, prompt in enumerate(PROMPTS):
                params = cllm.SamplingParams(max_tokens=20 + 3 * i, temperature=0, logprobs=5, ignore_eos=True,
                                             stop=[" return", " pandas"] if i % 3 == 1 else None)
                engine.add_request(prompt, params, request_id=f"r{i}")
            outs, steps = {}, 0
            while engine.has_unfinished():
                if steps == 12:
                    outs["r4"] = engine.abort_request("r4")  # queued by then, in both runs
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out
                steps += 1
            runs[lookahead] = outs
            if lookahead == "on":
                assert engine.ahead_used > 0
                assert engine.scheduler.num_preemptions > 0  # 3 sequences of up to ~50 tokens in 80 slots
                _check_cached_blocks(engine, outs)
    assert runs["on"].keys() == runs["off"].keys() and "r4" in runs["on"]
    assert runs["on"]["r4"].outputs[0].finish_reason == "abort"
    assert any(o.outputs[0].finish_reason == "stop" for o in runs["off"].values())
    for rid, off in runs["off"].items():
        off, on = off.outputs[0], runs["on"][rid].outputs[0]
        compared = _compare_until_near_tie(off, on)
        if off.finish_reason != "abort":
            assert compared > 0, rid


def _tokens_and_logprobs(out: cllm.RequestOutput) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.text, [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in c.logprobs]


def _compare_until_near_tie(off, on) -> int:
    """Positions compared: tokens equal and logprobs within ATOL until the run without the lookahead had a
    near-tie (where rounding may choose either token); returns how many were compared."""
    n = 0
    for a, b in zip(off.logprobs, on.logprobs):
        tops = [t.logprob for t in a.top]
        if len(tops) > 1 and tops[0] - tops[1] < TIE:
            break
        assert a.token_id == b.token_id, (n, off.text, on.text)
        assert abs(a.logprob - b.logprob) < ATOL
        n += 1
    else:
        if off.finish_reason != "abort":
            assert off.token_ids == on.token_ids and off.finish_reason == on.finish_reason
    return n


def _check_cached_blocks(engine, outs) -> None:
    """Every block the prefix cache holds is a block of some sequence's real tokens (rows launched ahead
    and dropped were never recorded)."""
    blocks = engine.backend.blocks
    size = blocks.block_size
    real = set()
    for out in outs.values():
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        real.update(tuple(tokens[i:i + size]) for i in range(0, len(tokens) - size + 1, size))
    cached = [blocks._blocks[b].tokens for b in blocks._cached.values()]
    assert cached and all(t in real for t in cached)


@pytest.mark.parametrize("sampler", ["numpy"])
def test_lookahead_on_needs_sampling_on_the_device(sampler):
    with pytest.raises(ValueError, match="scheduler.lookahead: on needs a backend that samples on its device"):
        cllm.LLM(backend="torch", dtype="float32", device="cpu", sampler=sampler, lookahead="on")
