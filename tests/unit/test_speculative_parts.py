"""The parts of speculative decoding that need no model: n-gram proposals, the step-cost curve, the plan.

And one engine-level check on the fake backend (its "model" counts: t -> t + 1), where speculation's
output must equal the output without it token for token, with the fake KV kept exact by
``Backend.truncate`` (the fake asserts every position it evaluates follows what it holds).
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cllm
from cllm.engine.llm_engine import LLMEngine
from cllm.speculative.ngram import NgramIndex
from cllm.speculative.planner import MIN_GAIN, EXPLORE_TOKENS, Candidate, plan
from cllm.speculative.step_cost import StepCost, context_class
from tests.unit.fakes import FakeBackend, fake_config, run_all


# ----------------------------------------------------------------------------------- n-grams

def reference_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """From scratch: the longest n (n_max down to n_min) whose last-n tokens occur ending before the
    end of the sequence; the k tokens the sequence would go on with if it repeated itself from its
    most recent such occurrence (token by token: each next token is the one that followed the
    position the draft has reached, the draft's own tokens included)."""
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if length < n:
            continue
        tail = list(tokens[length - n:])
        for end in range(length - 1, n - 1, -1):  # most recent first; end == length is the tail itself
            if list(tokens[end - n:end]) == tail:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[end + i])
                return seq[length:]
    return []


def test_ngram_prefers_the_longest_match_over_a_more_recent_shorter_one():
    idx = NgramIndex(2, 4)
    #         0  1  2  3  4  5   6  7  8   9  10  11
    tokens = [1, 2, 3, 4, 50, 51, 3, 4, 60, 2, 3, 4]
    # "2 3 4" (3-gram) ended at position 4 -> [50, 51, ...]; "3 4" alone ended more recently, at 8 -> [60, ...]
    assert idx.propose(tokens, 3) == [50, 51, 3]


def test_ngram_takes_the_most_recent_occurrence():
    idx = NgramIndex(2, 2)
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert idx.propose(tokens, 2) == [2, 7]


def test_ngram_never_matches_the_tail_itself_and_respects_k():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5], 8) == []  # no n-gram occurs twice
    assert NgramIndex(1, 1).propose([9], 4) == []  # a single token cannot match anything before it
    tokens = list(range(10)) + list(range(3))  # 0..9 then 0 1 2: proposes 3 4 5 ...
    assert NgramIndex(2, 3).propose(tokens, 4) == [3, 4, 5, 6]


def test_ngram_draft_goes_on_repeating_a_pattern_past_the_sequence_end():
    """A match less than k tokens back runs out at the end of the sequence; the draft repeats what
    followed it (period: the distance to the match), as the sequence would if the pattern holds."""
    assert NgramIndex(2, 2).propose([5, 5, 5], 8) == [5] * 8  # period 1
    tokens = list(range(10)) + list(range(3))  # 0..9 0 1 2: the match ended at 3, period 10
    assert NgramIndex(2, 3).propose(tokens, 12) == list(range(3, 10)) + [0, 1, 2, 3, 4]
    #                    a  b  c  a  b  c  a  b: "a b" last ended at 5, period 3
    assert NgramIndex(2, 2).propose([1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.data())
def test_ngram_incremental_index_equals_a_search_from_scratch(tokens, data):
    n_min = data.draw(st.integers(1, 3))
    n_max = data.draw(st.integers(n_min, 5))
    idx = NgramIndex(n_min, n_max)
    # The engine passes the prompt and the output apart: the prompt once whole, the output growing by
    # 1..4 tokens between lookups (one, or an accepted draft and the model's next token).
    num_prompt = data.draw(st.integers(1, len(tokens)))
    prompt, length = tokens[:num_prompt], num_prompt
    while True:
        k = data.draw(st.integers(1, 8))
        got = idx.propose(prompt, k, tokens[num_prompt:length])
        assert got == reference_propose(tokens[:length], k, n_min, n_max)
        if length == len(tokens):
            break
        length = min(len(tokens), length + data.draw(st.integers(1, 4)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.data())
def test_ngram_index_of_a_growing_prompt_alone(tokens, data):
    idx = NgramIndex(2, 4)
    length = 0
    while length < len(tokens):
        length = min(len(tokens), length + data.draw(st.integers(1, 4)))
        assert idx.propose(tokens[:length], 5) == reference_propose(tokens[:length], 5, 2, 4)


# --------------------------------------------------------------------------------- step cost

def test_step_cost_unknown_until_two_buckets():
    cost = StepCost()
    assert cost.seconds(1) is None
    for _ in range(5):
        cost.observe(1, 0.01)
    assert cost.seconds(1) is None  # one bucket (token count 1) only
    cost.observe(0, 0.5)
    cost.observe(3, 0.0)  # ignored: no tokens, no time
    assert cost.seconds(1) is None
    cost.observe(3, 0.02)  # bucket of 2..3 tokens
    assert cost.seconds(1) == pytest.approx(0.01) and cost.seconds(3) == pytest.approx(0.02)


def test_step_cost_interpolates_and_extends_with_the_last_slope():
    cost = StepCost()
    cost.observe(1, 0.010)
    cost.observe(4, 0.016)
    cost.observe(16, 0.040)
    assert cost.seconds(2) == pytest.approx(0.012)  # between 1 and 4: 2 ms per token
    assert cost.seconds(10) == pytest.approx(0.028)  # between 4 and 16: 2 ms per token
    assert cost.seconds(32) == pytest.approx(0.072)  # past 16: the last slope goes on
    assert cost.seconds(0) == pytest.approx(0.008)  # before 1: the first slope, never below 0
    # A bucket's point follows its recent steps.
    for _ in range(200):
        cost.observe(5, 0.020)
    assert cost.seconds(5) == pytest.approx(0.020, rel=1e-6)


def test_step_cost_one_slow_step_does_not_set_the_cost():
    # The first step of a shape can include one-off work (llama.cpp allocating compute buffers: 2 s
    # against 12 ms); it must not make speculation look expensive for the steps after it.
    cost = StepCost()
    for n, seconds in [(1, 0.012)] * 5 + [(4, 2.0)] + [(4, 0.015)] * 6:
        cost.observe(n, seconds)
    assert cost.seconds(4) == pytest.approx(0.015)


def test_step_cost_is_monotone_under_noisy_timings():
    rng = random.Random(7)
    cost = StepCost()
    for _ in range(3000):
        n = rng.choice([1, 1, 1, 2, 3, 5, 8, 13, 24, 40, 64, 100, 200, 500])
        cost.observe(n, (0.01 + 0.0002 * n) * rng.lognormvariate(0, 0.5))  # heavy timing noise
    values = [cost.seconds(n) for n in range(0, 1025)]
    assert all(v is not None and v >= 0 for v in values)
    assert all(b >= a for a, b in zip(values, values[1:])), "a bigger step was estimated cheaper"
    # A bigger step timed faster than a smaller one (noise) never makes it count as cheaper.
    cost = StepCost()
    cost.observe(2, 0.03)
    cost.observe(40, 0.01)
    assert cost.seconds(40) == pytest.approx(0.03) and cost.seconds(100) == pytest.approx(0.03)


def test_step_cost_below_the_first_measured_count_is_never_free():
    # Decode steps of 4 sequences measured first (the exploration gave them 16 draft tokens), then one
    # sequence left: its 1-token step lies below every measured count. The last slope carried below
    # the first point went under 0, and a plan divided by that cost.
    cost = StepCost()
    for _ in range(3):
        cost.observe(4, 0.030)
        cost.observe(20, 0.200)
    one = cost.seconds(1)
    assert one is not None and one >= 0.030 / 4  # a step costs at least its share of a measured one
    assert cost.seconds(4) == pytest.approx(0.030) and cost.seconds(2) <= cost.seconds(3) <= cost.seconds(4)
    cand = [Candidate(acceptance=0.9, limit=8)]
    plan(cand, base_tokens=1, num_sampled=1, cost=cost, budget=100)  # (was: ZeroDivisionError)
    assert 0 <= cand[0].take <= 8


def test_step_cost_keeps_a_curve_per_context_class_and_borrows_the_nearest():
    # Measured on the embedded model (2 threads, AVX-512 EPYC, flash attention on): 1- and 8-token steps
    # cost 10 and 20 ms at 64 tokens of context, 11 and 43 ms at 1,024.
    cost = StepCost()
    for _ in range(3):
        cost.observe(1, 0.010, context=64)
        cost.observe(8, 0.020, context=72)
    assert cost.seconds(8, context=1024) == pytest.approx(0.020)  # not measured there yet: the nearest class
    for _ in range(3):
        cost.observe(1, 0.011, context=1025)
        cost.observe(8, 0.043, context=1032)
    assert cost.seconds(8, context=60) == pytest.approx(0.020)
    assert cost.seconds(8, context=1500) == pytest.approx(0.043)
    assert cost.seconds(8, context=700) == pytest.approx(0.043)  # between the two, the nearer (512-1023: 1024-2047)
    assert cost.seconds(8, context=5000) == pytest.approx(0.043)
    assert [context_class(n) for n in (0, 127, 128, 255, 256, 1023, 1024)] == [0, 0, 1, 1, 2, 3, 4]


def test_plan_prices_drafts_at_the_context_the_sequence_has():
    """A likely draft pays at a short context and not at a long one, where each token attends to a
    thousand more (the curves measured above)."""
    cost = StepCost()
    for n, short, long in [(1, 0.010, 0.011), (2, 0.0114, 0.0156), (4, 0.0143, 0.025), (8, 0.020, 0.043)]:
        for _ in range(3):
            cost.observe(n, short, context=64)
            cost.observe(n, long, context=1100)
    short = [Candidate(acceptance=0.4, limit=7, context=64)]
    plan(short, base_tokens=1, num_sampled=1, cost=cost, budget=100, context=64)
    long = [Candidate(acceptance=0.4, limit=7, context=1100)]
    plan(long, base_tokens=1, num_sampled=1, cost=cost, budget=100, context=1100)
    assert short[0].take > 0 and long[0].take == 0


# ------------------------------------------------------------------------------------- plan

def linear_cost(per_token: float, fixed: float = 0.0) -> StepCost:
    cost = StepCost()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        cost.observe(n, fixed + per_token * n)
    return cost


def test_plan_busy_batch_with_linear_cost_proposes_nothing():
    cost = linear_cost(0.001)  # every token costs the same: extra tokens are never cheaper than decodes
    candidates = [Candidate(acceptance=0.98, limit=24) for _ in range(64)]
    plan(candidates, base_tokens=64, num_sampled=64, cost=cost, budget=1000)
    assert [c.take for c in candidates] == [0] * 64
    # Even with a fixed cost per step, 64 sure tokens outweigh a 0.9-likely one.
    cost = linear_cost(0.001, fixed=0.005)
    candidates = [Candidate(acceptance=0.9, limit=24) for _ in range(64)]
    plan(candidates, base_tokens=64, num_sampled=64, cost=cost, budget=1000)
    assert sum(c.take for c in candidates) == 0


def measured_llama_cpp_cost() -> StepCost:
    """Decode steps of the embedded model on the 2-core Xeon, llama.cpp, by tokens (one sequence with
    drafts at 1-5 tokens, 16 and 64 sequences without): the vs_llama_server.py workload (a) runs."""
    cost = StepCost()
    for n, seconds in [(1, 0.0146), (2, 0.0195), (3, 0.0233), (5, 0.0330), (16, 0.053), (64, 0.170)]:
        for _ in range(3):
            cost.observe(n, seconds)
    return cost


def test_plan_where_drafts_run_apart_a_busy_batch_pays_a_pass_per_drafting_sequence():
    """llama.cpp's split KV cache runs each drafting sequence of a multi-sequence step as a pass of its
    own: 16 sequences, likely drafts. Counted by tokens, drafting pays (a 16-token step costs little
    more than a 1-token one); counted per pass, it does not (measured: 141 ms against 53 for 16
    sequences with 6 draft tokens among them)."""
    cost = measured_llama_cpp_cost()
    by_tokens = [Candidate(acceptance=0.8, limit=8) for _ in range(16)]
    plan(by_tokens, base_tokens=16, num_sampled=16, cost=cost, budget=1000)
    assert sum(c.take for c in by_tokens) > 0
    apart = [Candidate(acceptance=0.8, limit=8) for _ in range(16)]
    plan(apart, base_tokens=16, num_sampled=16, cost=cost, budget=1000, apart=True)
    assert sum(c.take for c in apart) == 0
    # One sequence alone runs its drafts in its own pass anyway: the same plan either way.
    alone, alone_apart = [Candidate(acceptance=0.9, limit=8)], [Candidate(acceptance=0.9, limit=8)]
    plan(alone, base_tokens=1, num_sampled=1, cost=cost, budget=100)
    plan(alone_apart, base_tokens=1, num_sampled=1, cost=cost, budget=100, apart=True)
    assert alone[0].take == alone_apart[0].take > 0
    # Unmeasured, a step where drafts run apart explores with one sequence, not all of them.
    fresh = [Candidate(acceptance=0.5, limit=8) for _ in range(16)]
    plan(fresh, base_tokens=16, num_sampled=16, cost=StepCost(), budget=1000, apart=True)
    assert [c.take for c in fresh] == [EXPLORE_TOKENS] + [0] * 15


def test_plan_one_likely_sequence_on_a_cheap_curve_gets_a_long_draft_bounded_by_limit_and_budget():
    cost = linear_cost(1e-5, fixed=0.010)  # weight-bandwidth bound: an extra token costs 0.1 % of a step
    one = [Candidate(acceptance=0.9, limit=24)]
    plan(one, base_tokens=1, num_sampled=1, cost=cost, budget=100)
    assert one[0].take == 24  # the limit binds
    one = [Candidate(acceptance=0.9, limit=24)]
    plan(one, base_tokens=1, num_sampled=1, cost=cost, budget=10)
    assert one[0].take == 10  # the budget binds
    one = [Candidate(acceptance=0.9, limit=5)]
    plan(one, base_tokens=1, num_sampled=1, cost=cost, budget=100)
    assert one[0].take == 5


def test_plan_low_acceptance_gets_few_and_never_more_than_high_acceptance():
    cost = linear_cost(0.0005, fixed=0.010)  # CPU-like: an extra token costs 5 % of a one-token step
    low, high = Candidate(acceptance=0.1, limit=24), Candidate(acceptance=0.9, limit=24)
    plan([low], base_tokens=1, num_sampled=1, cost=cost, budget=100)
    plan([high], base_tokens=1, num_sampled=1, cost=cost, budget=100)
    assert 0 <= low.take <= 2 and low.take < high.take < 24
    zero = Candidate(acceptance=0.0, limit=24)
    plan([zero], base_tokens=1, num_sampled=1, cost=cost, budget=100)
    assert zero.take == 0
    a, b = Candidate(acceptance=0.3, limit=24), Candidate(acceptance=0.8, limit=24)
    plan([a, b], base_tokens=2, num_sampled=2, cost=cost, budget=100)
    assert a.take <= b.take


def expected_rate(takes: Sequence[int], accept: Sequence[float], base: int, sampled: int, cost: StepCost,
                  depth_seconds: float) -> float:
    """The planner's own model: expected tokens emitted / expected seconds of the step."""
    emitted = sampled + sum(sum(a ** j for j in range(1, t + 1)) for t, a in zip(takes, accept))
    seconds = cost.seconds(base + sum(takes)) + depth_seconds * max(takes, default=0)
    return emitted / seconds


@pytest.mark.parametrize("depth_seconds", [0.0, 0.004])
def test_plan_single_sequence_is_the_best_draft_length_of_its_model(depth_seconds):
    """For one sequence the plan is the draft length with the highest expected tokens per second, where a
    draft model costs ``depth_seconds`` per depth (each depth is one draft decode) -- up to the draft
    tokens whose gain is below MIN_GAIN, which the planner never weighs: within that, the best rate."""
    cost = linear_cost(1e-6, fixed=0.010)
    for acceptance in (0.5, 0.8, 0.9, 0.98):
        cand = [Candidate(acceptance=acceptance, limit=24)]
        plan(cand, base_tokens=1, num_sampled=1, cost=cost, budget=100, depth_seconds=depth_seconds)
        weighed = [t for t in range(25) if t == 0 or acceptance ** t >= MIN_GAIN]
        rates = [expected_rate([t], [acceptance], 1, 1, cost, depth_seconds) for t in range(25)]
        best = max(weighed, key=rates.__getitem__)
        assert cand[0].take == best, (acceptance, cand[0].take, best, rates[cand[0].take], rates[best])
        assert rates[cand[0].take] >= 0.97 * max(rates)  # what the gains below MIN_GAIN would have added


def test_plan_finds_a_draft_length_that_pays_after_a_cost_jump():
    """A step cost that jumps at the first extra token (CUDA: a pure decode replays a graph, a step with
    drafts runs eagerly) and is flat after it: one draft token does not pay, eight do at acceptance 0.9;
    at 0.3 none pays."""
    class Jump:
        def seconds(self, tokens: int, context: int = 0) -> float:
            return 0.002 if tokens <= 1 else 0.006

    for acceptance, pays in ((0.9, True), (0.3, False)):
        cand = [Candidate(acceptance=acceptance, limit=16)]
        plan(cand, base_tokens=1, num_sampled=1, cost=Jump(), budget=100)
        assert (cand[0].take > 1) is pays, (acceptance, cand[0].take)


def test_plan_respects_the_budget_and_limits():
    rng = random.Random(3)
    for trial in range(200):
        cost = linear_cost(rng.choice([1e-6, 1e-4, 1e-3]), fixed=rng.choice([0.0, 0.005, 0.02]))
        if trial % 4 == 0:
            cost = StepCost()  # unknown: exploration
        cands = [Candidate(acceptance=rng.random(), limit=rng.randint(0, 30)) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(0, 60)
        plan(cands, base_tokens=len(cands), num_sampled=len(cands), cost=cost, budget=budget,
             depth_seconds=rng.choice([0.0, 0.001]))
        assert sum(c.take for c in cands) <= budget
        assert all(0 <= c.take <= c.limit for c in cands)


def test_plan_explores_while_the_cost_is_unknown():
    cost = StepCost()
    cands = [Candidate(acceptance=0.5, limit=24), Candidate(acceptance=0.5, limit=2), Candidate(acceptance=0.5, limit=24)]
    plan(cands, base_tokens=3, num_sampled=3, cost=cost, budget=100)
    assert [c.take for c in cands] == [EXPLORE_TOKENS, 2, EXPLORE_TOKENS]
    cands = [Candidate(acceptance=0.5, limit=24) for _ in range(3)]
    plan(cands, base_tokens=3, num_sampled=3, cost=cost, budget=EXPLORE_TOKENS + 1)
    assert [c.take for c in cands] == [EXPLORE_TOKENS, 1, 0]  # the budget still holds


# ------------------------------------------------------------------- the engine, fake backend

class SpeculatingFake(FakeBackend):
    """The counting fake with ``truncate``: its KV list is cut like llama.cpp's seq_rm cuts a tail."""

    supports_speculation = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.truncated: list[tuple[str, int]] = []

    def truncate(self, sequence_id: str, num_tokens: int) -> int:
        self.truncated.append((sequence_id, num_tokens))
        del self.kv[sequence_id][num_tokens:]
        return len(self.kv[sequence_id])


def fake_engine(**overrides) -> LLMEngine:
    config = fake_config(n_seq_max=4, **overrides)
    return LLMEngine(config, SpeculatingFake(slots=4, max_batch_tokens=64))


def test_engine_on_the_fake_output_equals_no_speculation_and_kv_is_rolled_back():
    # The counting model continues 0 1 2 3 ...; a prompt that repeats "a..e" and then breaks the
    # pattern gives n-gram drafts that are partly right, partly wrong (rejected, then truncated).
    prompts = ["abcdeabcdeabcdeab", "xyzxyzxyzxyzx", "abcabcabcabcab"]
    params = [cllm.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (13, 20, 7)]
    results = {}
    for spec in ("off", "ngram"):
        engine = fake_engine(speculative=spec)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"r{i}")
        results[spec] = run_all(engine)
        if spec == "ngram":
            stats = engine.speculator.stats
            backend = engine.backend
    for rid, out in results["off"].items():
        got = results["ngram"][rid]
        assert got.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == got.usage.completion_tokens
    assert [len(results["ngram"][f"r{i}"].outputs[0].token_ids) for i in range(3)] == [13, 20, 7]  # max_tokens exact
    assert stats.proposed_tokens > stats.accepted_tokens > 0 and backend.truncated
    assert stats.emitted_tokens == stats.accepted_tokens + stats.verify_steps
    # Batches held draft tokens: some step evaluated more than one token of a decoding sequence.
    assert any(sum(1 for s in seqs if s == "r0") > 1 and pos[seqs.index("r0")] >= len(prompts[0])
               for _, pos, seqs in backend.batches)


class FlatCost(StepCost):
    """Timing that does not depend on this machine: 10 ms a step, 10 us a token."""

    def observe(self, num_tokens: int, seconds: float, context: int = 0) -> None:
        pass

    def seconds(self, num_tokens: int, context: int = 0) -> float:
        return 0.010 + 1e-5 * num_tokens


def test_a_request_ending_at_max_tokens_does_not_stop_the_next_one_speculating():
    # One stream of requests, one after another. At a request's last token no draft fits (max_tokens):
    # that says nothing about whether speculation pays at this batch size, and must not keep the next
    # request from speculating.
    engine = fake_engine(speculative="ngram", num_speculative_tokens=4)
    engine.speculator.cost = FlatCost()
    params = cllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # 1 + 5 + 5, then 1 more
    steps = {}
    for rid in ("first", "second"):
        engine.add_request(list(range(64)) + list(range(10)), params, request_id=rid)
        steps[rid] = 0
        while engine.has_unfinished():
            engine.step()
            steps[rid] += 1
    # The counting model goes on 10, 11, ... as the prompt did: every draft is accepted, so each request
    # takes its prefill and a few verifying steps, not twelve decodes.
    assert steps["second"] == steps["first"] <= 5, steps


def test_drafts_stay_within_the_step_token_budget():
    engine = fake_engine(speculative="ngram", max_num_batched_tokens=16)
    engine.speculator.cost = FlatCost()  # drafts as long as the plan allows: 24 a sequence
    prompt = list(range(64)) + list(range(10))
    params = cllm.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(prompt, params, request_id=f"r{i}")
    outs = run_all(engine)
    assert all(o.outputs[0].token_ids == list(range(10, 50)) for o in outs.values())
    assert engine.speculator.stats.accepted_tokens > 0
    assert max(len(flat) for flat, _, _ in engine.backend.batches) <= 16


def test_draft_model_kv_follows_the_sequence_when_a_draft_is_dropped():
    """The draft model decodes its draft tokens into its own KV; when the scheduler then drops the draft
    (no KV room for it in the target) no verification syncs it. Whatever the target emits next, the
    draft model's KV must hold the sequence's own tokens before it drafts again."""
    from cllm.request import Request
    from cllm.speculative.draft_model import DraftModel

    backend = SpeculatingFake(slots=2, max_batch_tokens=64)
    draft = DraftModel(backend, vocab_size=backend.tokenizer.vocab_size)
    req = Request("r", [5, 6, 7, 8], cllm.SamplingParams(max_tokens=40, temperature=0), 40)
    assert draft.propose([(req, 3)]) == {"r": [9, 10, 11]}  # the counting model's own continuation
    req.output_token_ids += [20, 21, 22, 23]  # the target went elsewhere, several steps, no drafts verified
    assert draft.propose([(req, 2)]) == {"r": [24, 25]}
    assert backend.kv["r"][:req.num_tokens] == req.all_token_ids  # (then the draft tokens it fed)


def test_where_drafts_run_apart_a_multi_sequence_step_with_drafts_is_not_a_cost_by_tokens():
    """Such a step ran several passes: observed by its tokens it would price a 4-token step at 0.5 s.
    Steps of one pass (no drafts, or one sequence alone with its drafts) are observed as before."""
    from types import SimpleNamespace

    from cllm.config import SpeculativeConfig
    from cllm.speculative.speculator import Speculator

    def chunk(num_tokens: int) -> SimpleNamespace:
        return SimpleNamespace(start=100, num_tokens=num_tokens, draft=list(range(num_tokens - 1)))

    observed = {}
    for apart in (True, False):
        spec = Speculator(SpeculativeConfig(speculative="ngram"), drafts_run_apart=apart)
        for _ in range(3):
            spec.observe_step([chunk(1) for _ in range(16)], 0.05)
            spec.observe_step([chunk(3), chunk(1)], 0.5)  # two sequences, one with drafts: two passes
            spec.observe_step([chunk(2)], 0.02)  # one sequence with its drafts: one pass
        observed[apart] = spec.cost.seconds(4)
        assert spec.cost.seconds(2) == pytest.approx(0.02)
    assert observed[True] < 0.05 < 0.5 == pytest.approx(observed[False])


def test_auto_is_ngram_on_llama_cpp_and_off_on_torch():
    from cllm.speculative.speculator import create_speculator

    backend = SpeculatingFake(slots=4)
    assert fake_config().model.backend == "llama_cpp"
    assert create_speculator(fake_config(), backend).method == "ngram"
    assert create_speculator(fake_config(backend="torch"), backend) is None
    assert create_speculator(fake_config(speculative="off"), backend) is None


def test_a_sequence_drafts_deeper_only_after_whole_drafts_are_accepted():
    """FIRST_DEPTH at first; a wholly accepted draft doubles the depth (up to num_speculative_tokens, and
    at least FIRST_DEPTH again); a rejection cuts it to twice what was accepted, at least RETRY_DEPTH (8:
    where a step's first extra token is dear, a 1-token draft never pays, and a depth of 1 never grew again)."""
    from cllm.config import SpeculativeConfig
    from cllm.request import Request
    from cllm.speculative import speculator as sp

    assert sp.FIRST_DEPTH == 8 and sp.RETRY_DEPTH == 8
    spec = sp.Speculator(SpeculativeConfig(speculative="ngram", num_speculative_tokens=24))
    req = Request("r", [1, 2, 3], cllm.SamplingParams(max_tokens=100, temperature=0), 100)
    seq = spec._sequence(req)
    depths = [seq.depth]
    for proposed, accepted in [(12, 12), (24, 24), (24, 3), (8, 0), (2, 2), (12, 5), (10, 10), (20, 20)]:
        spec.verified(req, proposed, accepted, accepted + 1)
        depths.append(seq.depth)
    assert depths == [8, 24, 24, 8, 8, 8, 10, 20, 24]


def test_a_new_sequence_starts_from_the_engines_recent_acceptance_of_its_kind_of_draft():
    """A server that has been copying text has a new request draft as a likely one; one whose drafts
    keep failing has it start cautious. Its own record then takes over. Each kind of n-gram draft (the
    length of the match it follows) has a record of its own: 2-token matches failing says nothing of
    4-token ones."""
    from cllm.config import SpeculativeConfig
    from cllm.request import Request
    from cllm.speculative import speculator as sp

    def sequence(name: str, kind: int) -> tuple[Request, object]:
        req = Request(name, [1, 2, 3], cllm.SamplingParams(max_tokens=100, temperature=0), 100)
        seq = spec._sequence(req)
        seq.kind = kind
        return req, seq

    spec = sp.Speculator(SpeculativeConfig(speculative="ngram", speculative_ngram_min=2, speculative_ngram_max=4))
    assert spec.prior(2) == spec.prior(4) == pytest.approx(sp.FIRST_PRIOR)
    (copying, _), (guessing, _) = sequence("copying", 4), sequence("guessing", 2)
    for _ in range(30):
        spec.verified(copying, 8, 8, 9)
        spec.verified(guessing, 8, 0, 1)
    new, seq = sequence("new", 4)
    likely, unlikely = spec.acceptance(seq, spec.prior(4))[0], spec.acceptance(seq, spec.prior(2))[0]
    assert likely > 0.9 and unlikely < 0.1
    spec.verified(new, 4, 0, 1)  # its own first draft fails
    assert spec.acceptance(seq, spec.prior(4))[0] < 0.5


def test_a_failed_start_does_not_keep_every_later_sequence_from_drafting():
    """Each kind's record fades with each new sequence back towards the first prior: after a few failed
    drafts and a run of requests that drafted nothing, a new request is tried again."""
    from cllm.config import SpeculativeConfig
    from cllm.request import Request
    from cllm.speculative import speculator as sp

    def request(i: int) -> Request:
        return Request(f"r{i}", [1, 2, 3], cllm.SamplingParams(max_tokens=100, temperature=0), 100)

    spec = sp.Speculator(SpeculativeConfig(speculative="ngram", speculative_ngram_min=3, speculative_ngram_max=3))
    spec._sequence(request(0))
    spec.verified(request(0), 4, 0, 1)  # the server's first draft fails
    spec._sequence(request(1))
    assert spec.prior(3) < 0.3
    priors = []
    for i in range(2, 12):  # ten requests that draft nothing
        spec._sequence(request(i))
        priors.append(spec.prior(3))
    assert priors == sorted(priors) and priors[-1] > 0.4
    assert priors[-1] < sp.FIRST_PRIOR  # the failure still counts a little


def test_an_unexplored_kind_of_draft_is_tried_then_priced_by_its_record():
    """Priced at the first prior, no draft pays where a step's first extra token is dear, so a kind never
    tried (or whose record has faded) is priced as likely, for a short draft, by a sequence with no recent
    rejection of its own; once tried it is priced by what happened (issue 45: the first failed 2-token
    match of a server kept its 4-token matches, real copies, from ever being tried)."""
    from cllm.config import SpeculativeConfig
    from cllm.request import Request
    from cllm.speculative import speculator as sp

    spec = sp.Speculator(SpeculativeConfig(speculative="ngram", speculative_ngram_min=2, speculative_ngram_max=4))
    req = Request("r", [1, 2, 3], cllm.SamplingParams(max_tokens=100, temperature=0), 100)
    seq = spec._sequence(req)
    assert not spec.explored(2)
    assert spec.acceptance(seq, spec.prior(2), explore=True) == (sp.EXPLORE_ACCEPTANCE, sp.EXPLORE_TOKENS)
    seq.kind = 2
    spec.verified(req, 4, 0, 1)  # the 2-token match's draft is rejected at once
    assert spec.explored(2) and not spec.explored(4) and seq.rejected_lately
    assert spec.acceptance(seq, spec.prior(2))[0] < 0.3
    for _ in range(2):  # two steps considered: the sequence's own rejection fades, the kind's does not
        seq.rest()
    assert not seq.rejected_lately and spec.explored(2)
    assert spec.acceptance(seq, spec.prior(4), explore=True) == (sp.EXPLORE_ACCEPTANCE, sp.EXPLORE_TOKENS)
    seq.kind = 4
    spec.verified(req, 4, 4, 5)  # the 4-token match's draft is kept: from now on priced by the record
    rate, most = spec.acceptance(seq, spec.prior(4))
    assert spec.explored(4) and rate > 0.8 and most == spec.max_tokens


def test_a_copying_sequence_drafts_again_after_its_first_short_match_failed():
    """End to end on the fake engine, the step cost steep at its first extra token (a 2-token step 2x a
    1-token one, as on the AVX-512/BF16 EPYC): the sequence's first draft follows a spurious 2-token
    match and is rejected; later it copies, and its 4-token matches are drafted and kept."""
    from cllm.speculative import speculator as sp

    engine = fake_engine(speculative="ngram", speculative_ngram_min=2, speculative_ngram_max=4)
    engine.speculator.cost = SteepCost()
    verifications = []
    verified = engine.speculator.verified
    engine.speculator.verified = lambda req, proposed, accepted, emitted: (
        verifications.append((proposed, accepted)), verified(req, proposed, accepted, emitted))
    # The counting model goes on 32, 33, ...: "31 32" occurs earlier followed by zeros (a spurious match),
    # and 33..49 is the text it then copies.
    prompt = [1, 31, 32, 0, 0, 0] + list(range(33, 50)) + [2, 30, 31]
    engine.add_request(prompt, cllm.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), request_id="r")
    out = run_all(engine)["r"]
    assert out.outputs[0].token_ids == list(range(32, 48))
    assert verifications[0] == (sp.EXPLORE_TOKENS, 0)  # the 2-token match, explored and rejected
    assert sum(accepted for _, accepted in verifications[1:]) >= 8  # then the copy, drafted and kept


class SteepCost(StepCost):
    """A step's first extra token costs as much again as the step (10 ms a token alone, 21 ms for two)."""

    def observe(self, num_tokens: int, seconds: float, context: int = 0) -> None:
        pass

    def seconds(self, num_tokens: int, context: int = 0) -> float:
        return 0.010 if num_tokens == 1 else 0.019 + 0.001 * num_tokens


def test_the_step_that_times_a_decode_for_the_stall_bound_carries_no_drafts():
    """With max_decode_stall_ms: auto, the step kept prompt-free to time a decode step of a new size class
    must be a pure decode: drafts there would make it a verification, leave the class unmeasured, and
    keep prompts out step after step. The steps before and after it draft as usual."""
    engine = fake_engine(speculative="ngram", max_num_batched_tokens=64)
    engine.speculator.cost = FlatCost()
    sched = engine.scheduler
    copying = list(range(40)) + list(range(10))  # a prompt whose continuation the n-gram index knows
    params = cllm.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(copying, params, request_id="a")
    engine.step()  # a's prompt (a 50-token step: the cost per token is measured)
    assert sched.seconds_per_token is not None and not sched.decode_seconds
    engine.add_request([i % 7 + 1 for i in range(60)], params, request_id="late")
    engine.step()  # a decodes, a prompt waits, no decode step of 1 measured: the probe step
    flat, _, seqs = engine.backend.batches[-1]
    assert seqs == ["a"] and len(flat) == 1  # no prompt tokens, no draft tokens
    assert 1 in sched.decode_seconds
    outs = run_all(engine)
    assert outs["a"].outputs[0].token_ids == list(range(10, 40))
    assert engine.speculator.stats.accepted_tokens > 0  # a drafted in the other steps


def test_a_one_stream_rest_ends_when_the_next_request_starts():
    """One stream: the request before found nothing worth drafting (its copy had ended), so the batch
    size rests REST_STEPS steps. That verdict was about its record, not the batch's cost: the next
    request, which copies, drafts from its first decode step."""
    from cllm.speculative import speculator as sp

    engine = fake_engine(speculative="ngram", num_speculative_tokens=4)
    engine.speculator.cost = FlatCost()
    params = cllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request([5, 3, 8, 1], params, request_id="before")  # nothing to copy
    run_all(engine)
    engine.speculator._resting[1] = sp.REST_STEPS  # what its last plan left
    engine.backend.batches.clear()
    engine.add_request(list(range(64)) + list(range(10)), params, request_id="next")
    run_all(engine)
    first_decode = next(pos for _, pos, _ in engine.backend.batches if pos[0] == 74)
    assert len(first_decode) == 5  # the decode and 4 draft tokens


def test_an_unexplored_longer_match_is_priced_at_least_as_a_shorter_one_that_was_kept():
    """Where 2-token matches are being copied, a first 3-token match is no less likely: it is priced at the
    2-token kind's rate and drafted as deep as the sequence goes, not explored EXPLORE_TOKENS at a time. A
    shorter kind that failed lends nothing: the longer one is still explored."""
    from cllm.config import SpeculativeConfig
    from cllm.request import Request
    from cllm.speculative import speculator as sp

    def fresh() -> tuple[sp.Speculator, Request, object]:
        spec = sp.Speculator(SpeculativeConfig(speculative="ngram", speculative_ngram_min=2, speculative_ngram_max=4))
        req = Request("r", [1, 2, 3], cllm.SamplingParams(max_tokens=100, temperature=0), 100)
        seq = spec._sequence(req)
        seq.kind = 2
        return spec, req, seq

    spec, req, seq = fresh()
    spec.verified(req, 4, 4, 5)  # a 2-token match's draft, kept whole
    assert spec.explored(2) and not spec.explored(3)
    assert spec.prior(3) == spec.prior(2) > sp.FIRST_PRIOR
    rate, most = spec.acceptance(seq, spec.prior(3), explore=not spec.explored(3))
    assert rate >= sp.EXPLORE_ACCEPTANCE and most == spec.max_tokens

    spec, req, seq = fresh()
    spec.verified(req, 4, 0, 1)  # a 2-token match's draft, rejected
    assert spec.prior(3) == pytest.approx(sp.FIRST_PRIOR)
    for _ in range(2):
        seq.rest()
    assert spec.acceptance(seq, spec.prior(3), explore=True) == (sp.EXPLORE_ACCEPTANCE, sp.EXPLORE_TOKENS)
