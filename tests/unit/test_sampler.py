"""Sampler statistics, seeds and parameter validation."""
from __future__ import annotations

import numpy as np
import pytest

from cllm.sampling.params import SamplingParams
from cllm.sampling.sampler import SamplingRow, sample


def row(params: SamplingParams, seed: int = 0, output=(), prompt=()) -> SamplingRow:
    return SamplingRow(params, np.random.default_rng(seed), list(prompt), list(output), frozenset({9}))


def draw_many(logits: np.ndarray, params: SamplingParams, n: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = [SamplingRow(params, rng, [], [], frozenset()) for _ in range(n)]
    return np.array([s.token_id for s in sample(np.repeat(logits[None], n, axis=0), rows)])


def test_greedy_picks_argmax():
    logits = np.array([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]], dtype=np.float32)
    out = sample(logits, [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))])
    assert [s.token_id for s in out] == [1, 0]


def test_temperature_sampling_matches_softmax_frequencies():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    tokens = draw_many(logits, SamplingParams(temperature=1.0))
    freq = np.bincount(tokens, minlength=3) / len(tokens)
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)


def test_top_k_top_p_min_p_truncate():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    assert set(draw_many(logits, SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draw_many(logits, SamplingParams(temperature=1.0, top_p=0.65))) == {0, 1}
    assert set(draw_many(logits, SamplingParams(temperature=1.0, min_p=0.6))) == {0, 1}
    freq = np.bincount(draw_many(logits, SamplingParams(temperature=1.0, top_k=2)), minlength=4) / 4000
    assert np.allclose(freq[:2], [0.4 / 0.7, 0.3 / 0.7], atol=0.03)


def test_seed_gives_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[1:2].copy(), [row(p, seed=7)])[0].token_id
    batch = sample(logits.copy(), [row(SamplingParams(temperature=0.5), 1), row(p, 7), row(SamplingParams(temperature=2.0), 3)])
    assert batch[1].token_id == alone


def test_penalties_and_logit_bias():
    logits = np.array([[2.0, 1.9, 0.0]], dtype=np.float32)
    out = sample(logits.copy(), [row(SamplingParams(temperature=0, presence_penalty=0.5), output=[0])])
    assert out[0].token_id == 1
    out = sample(logits.copy(), [row(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])])
    assert out[0].token_id == 1
    out = sample(logits.copy(), [row(SamplingParams(temperature=0, frequency_penalty=0.05), output=[0, 0, 0])])
    assert out[0].token_id == 1
    out = sample(logits.copy(), [row(SamplingParams(temperature=0, logit_bias={2: 5.0}))])
    assert out[0].token_id == 2


def test_min_tokens_suppresses_stop_ids():
    logits = np.zeros((1, 12), dtype=np.float32)
    logits[0, 9] = 10.0
    out = sample(logits.copy(), [row(SamplingParams(temperature=0, min_tokens=3), output=[1])])
    assert out[0].token_id != 9


def test_logprobs_are_normalised_and_top_sorted():
    logits = np.log(np.array([[0.1, 0.6, 0.3]], dtype=np.float32))
    out = sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])[0]
    assert out.token_id == 1 and out.logprob == pytest.approx(np.log(0.6), abs=1e-5)
    assert out.top_ids == [1, 2]
    assert np.exp(out.top_logprobs) == pytest.approx([0.6, 0.3], abs=1e-5)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"logprobs": 50}, "logprobs"),
    ({"min_p": 2}, "min_p"), ({"presence_penalty": 5}, "presence_penalty"), ({"stop": [""]}, "stop"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"), ({"seed": 1.5}, "seed"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {1: 1000}}, "logit_bias"),
])
def test_invalid_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


# ---- the top-candidates path (issue 8: no full-vocabulary passes per row) --------------------

def _reference_top(row_logits: np.ndarray, k: int) -> list[int]:
    """Brute force: ids by value descending, ties by lower id."""
    return [int(i) for i in np.lexsort((np.arange(len(row_logits)), -row_logits))[:k]]


@pytest.mark.parametrize("vocab, k", [(49_152, 50), (49_152, 256), (128_256, 1), (300, 20)])
def test_top_candidates_are_the_exact_top_k_with_ties_by_id(vocab, k):
    from cllm.sampling.sampler import top_candidates

    rng = np.random.default_rng(vocab + k)
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    logits[1, :400] = 9.0  # a tie wider than k at the top: lower ids win
    logits[2, ::97] = 5.0  # ties spread over the strided groups
    logits[3, k // 2:] = -np.inf  # a grammar mask: fewer finite values than k, -inf ties by id
    logits[4, :] = -np.abs(logits[4, :])  # all negative, with -0.0 and 0.0 both present
    logits[4, 7], logits[4, 8] = -0.0, 0.0
    for i, ids in enumerate(top_candidates(logits, k)):
        assert ids.tolist() == _reference_top(logits[i], k)


def test_candidate_draws_follow_the_truncated_distribution_on_a_large_vocabulary():
    vocab = 20_000  # above 4 x CANDIDATE_GROUPS: the strided-group bound is used
    logits = np.full(vocab, -30.0, dtype=np.float32)
    logits[[17, 4000, 9_999]] = np.log([0.5, 0.3, 0.2])
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_k=2), n=2000)
    freq = np.bincount(tokens, minlength=vocab)[[17, 4000, 9_999]] / len(tokens)
    assert np.allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0.0], atol=0.04)
    assert set(draw_many(logits, SamplingParams(temperature=1.0, top_p=0.75), n=1000)) == {17, 4000}
    assert set(draw_many(logits, SamplingParams(temperature=1.0, min_p=0.5), n=1000)) == {17, 4000}


def test_flat_distribution_falls_back_to_the_whole_vocabulary():
    # 1000 equally likely tokens: top_p=0.9 needs 900 of them, more than the 256 candidates;
    # min_p=0.5 keeps all 1000. Both must still draw from the right set.
    vocab = 10_000
    logits = np.full(vocab, -50.0, dtype=np.float32)
    logits[5000:6000] = 0.0
    top_p = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.9), n=2000)
    assert top_p.min() >= 5000 and top_p.max() < 6000 and len(set(top_p.tolist())) > 700
    min_p = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.5), n=2000)
    assert min_p.min() >= 5000 and min_p.max() < 6000 and min_p.max() > 5950


def test_batched_penalties_equal_one_row_at_a_time():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=-0.5),
              SamplingParams(temperature=0, repetition_penalty=0.7)]
    rows = [row(p, i, output=rng.integers(0, 1000, 30).tolist(), prompt=rng.integers(0, 1000, 20).tolist())
            for i, p in enumerate(params)]
    expected = logits.copy()
    for i, r in enumerate(rows):
        p = r.params
        seen = np.unique(np.array(r.prompt_token_ids + r.output_token_ids))
        vals = expected[i, seen]
        expected[i, seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        ids, counts = np.unique(np.array(r.output_token_ids), return_counts=True)
        expected[i, ids] -= p.frequency_penalty * counts + p.presence_penalty
    from cllm.sampling.sampler import _apply_penalties

    got = logits.copy()
    _apply_penalties(got, rows)
    assert np.allclose(got, expected, atol=1e-6)


def test_candidate_draws_do_not_depend_on_batch_mates():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(4, 20_000)).astype(np.float32) * 3
    truncating = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1), SamplingParams(temperature=1.3, top_p=0.5),
                  SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95), SamplingParams(temperature=0.9, top_k=5)]
    for seed in range(20):
        alone = [sample(logits[i:i + 1].copy(), [row(p, seed)])[0].token_id for i, p in enumerate(truncating)]
        together = [s.token_id for s in sample(logits.copy(), [row(p, seed) for p in truncating])]
        assert together == alone


def test_nucleus_held_by_the_top_token_alone_takes_it_with_one_draw_whatever_the_batch():
    """A top_p row whose top token holds the mass by itself takes that token (lowest id among ties) and
    uses exactly one draw of its generator, as every sampled token does; a batch mixing such rows with
    rows that need candidates gives each row what it gets alone."""
    rng = np.random.default_rng(3)
    vocab = 5000
    logits = rng.normal(size=(6, vocab)).astype(np.float32)
    logits[0, 17] += 14.0  # ~99.9 % at T=0.8: the nucleus is token 17 alone
    logits[1, 4000] += 14.0
    logits[2, 9] += 4.0  # a few % only: the nucleus needs candidates
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1), SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.2, top_p=0.5),
              SamplingParams(temperature=0.8, top_p=0.95, top_k=50), SamplingParams(temperature=1.0)]
    for seed in range(10):
        rows = [row(p, seed) for p in params]
        together = [s.token_id for s in sample(logits.copy(), rows)]
        alone = [sample(logits[i:i + 1].copy(), [row(p, seed)])[0].token_id for i, p in enumerate(params)]
        assert together == alone
        assert together[:2] == [17, 4000]
        once = np.random.default_rng(seed)
        once.random()
        assert rows[0].rng.random() == once.random()  # one draw used, no more


def test_top_p_frequencies_follow_the_nucleus_on_a_large_vocabulary():
    """Where the top token alone does not hold the mass, the draw spreads over the nucleus exactly."""
    vocab = 3000
    logits = np.full(vocab, -20.0, dtype=np.float32)
    logits[[5, 70, 2500]] = np.log([0.6, 0.3, 0.1])
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert set(tokens) == {5, 70}
    assert abs(np.mean(tokens == 5) - 2 / 3) < 0.03


def test_wide_nucleus_rows_get_the_same_token_and_draws_alone_as_in_a_large_batch():
    """Up to FEW_ROWS wide nucleus rows are settled one at a time in Python floats, more with batch
    arrays: a row gets the same token and leaves its generator in the same state either way, whether
    the bound settles it (a peak of +14), only its exact total does (+8 to +9 at T=0.5, where the bound
    is too loose) or it needs candidates (+4)."""
    from cllm.sampling import sampler

    rng = np.random.default_rng(5)
    vocab = 4096
    peaks = [14.0, 14.0, 8.0, 8.5, 9.0, 4.0, 4.0, 14.0, 8.0, 4.0]
    logits = rng.normal(size=(len(peaks), vocab)).astype(np.float32)
    for i, peak in enumerate(peaks):
        logits[i, 100 + 37 * i] += peak
    params = [SamplingParams(temperature=t, top_p=p) for t, p in
              [(0.8, 0.95), (0.5, 0.9), (0.5, 0.95), (0.5, 0.99), (0.5, 0.95), (0.8, 0.95), (1.0, 0.7), (0.3, 0.999),
               (0.5, 0.9), (0.8, 0.95)]]
    assert len(peaks) > sampler.FEW_ROWS
    ways = {"bound": 0, "exact": 0, "candidates": 0}
    for i, p in enumerate(params):  # which way each row is settled, worked out here in float64
        x = np.sort(logits[i].astype(np.float64))
        if p.top_p * (1 + (vocab - 1) * np.exp((x[-2] - x[-1]) / p.temperature)) * (1 + 1e-6) <= 1:
            ways["bound"] += 1
        else:
            ways["exact" if p.top_p * np.exp((x - x[-1]) / p.temperature).sum() <= 1 else "candidates"] += 1
    assert all(ways.values()), ways  # every way is exercised
    for seed in range(8):
        rows = [row(p, seed) for p in params]
        together = [s.token_id for s in sample(logits.copy(), rows)]
        alone_rows = [row(p, seed) for p in params]
        alone = [sample(logits[i:i + 1].copy(), [alone_rows[i]])[0].token_id for i in range(len(params))]
        assert together == alone
        assert [r.rng.random() for r in rows] == [r.rng.random() for r in alone_rows]


def test_uniforms_drawn_ahead_are_the_generators_own_stream_and_its_state_stays_exact():
    """SamplingRow.uniform draws UNIFORMS_AHEAD numbers at a time; they are the numbers single
    rng.random() calls give, and ``rng`` (for a state snapshot) is positioned after the ones used."""
    from cllm.sampling import sampler

    for used in (0, 1, 5, sampler.UNIFORMS_AHEAD - 1, sampler.UNIFORMS_AHEAD, sampler.UNIFORMS_AHEAD + 3):
        r = row(SamplingParams(temperature=1.0), seed=11)
        plain = np.random.default_rng(11)
        assert [r.uniform() for _ in range(used)] == [plain.random() for _ in range(used)]
        assert r.rng.bit_generator.state == plain.bit_generator.state
        assert r.rng.random() == plain.random()  # drawn straight from the generator after a snapshot
        assert [r.uniform() for _ in range(3)] == [plain.random() for _ in range(3)]


def test_a_row_given_a_seed_makes_its_generator_on_first_use_the_same_stream():
    """SamplingRow(params, seed): the generator is made when first needed (a draw or ``rng``), and it is the one
    np.random.default_rng(seed) makes; a greedy request of an engine never makes one."""
    from cllm.bench.null_backend import NullBackend
    from cllm.config import load_config
    from cllm.engine.llm_engine import LLMEngine

    for used in (0, 1, 70):
        lazy, plain = SamplingRow(SamplingParams(temperature=1.0), 11, [], [], frozenset()), np.random.default_rng(11)
        assert [lazy.uniform() for _ in range(used)] == [plain.random() for _ in range(used)]
        assert lazy.rng.bit_generator.state == plain.bit_generator.state
    engine = LLMEngine(load_config(None, environ={}, n_seq_max=4), backend=NullBackend(slots=4))
    try:
        greedy = engine.add_request([300, 301], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        seeded = engine.add_request([300, 301], SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True))
        engine.step()
        engine.step()
        seed = engine._rows[greedy]._rng
        assert isinstance(seed, int)  # never drawn from: never made
        assert isinstance(engine._rows[seeded]._rng, np.random.Generator)
        assert engine.rng_of(greedy).bit_generator.state == np.random.default_rng(seed).bit_generator.state  # (hand-off)
    finally:
        engine.close()


def test_near_bound_never_falls_below_the_exact_total_and_settles_clear_rows():
    """_near_bound (one row's tighter bound) is an upper bound on the float32 exact softmax total within
    the 1e-6 margin the callers apply, and above it by at most half of what top_p leaves beside the top
    token, on peaked, flat and masked rows and at any temperature."""
    from cllm.sampling import sampler

    rng = np.random.default_rng(8)
    settled = 0
    for trial in range(400):
        vocab = int(rng.choice([300, 1024, 5000]))
        row = rng.normal(scale=float(rng.choice([0.5, 1.0, 3.0])), size=vocab).astype(np.float32)
        row[rng.integers(vocab)] += float(rng.uniform(0, 16))
        if trial % 7 == 0:
            row[rng.integers(vocab, size=vocab // 3)] = -np.inf  # a grammar's mask
        temp, top_p = float(rng.choice([0.3, 0.8, 1.5])), float(rng.choice([0.5, 0.9, 0.95, 0.999]))
        best = float(row.max())
        exact = float(sampler._softmax_totals(row[None], np.array([0]), np.array([best]), np.array([temp]))[0])
        bound = sampler._near_bound(row, best, temp, top_p)
        slack = 1 / top_p - 1  # what top_p leaves beside the top token's weight of 1
        assert exact <= bound * (1 + 1e-6), (trial, bound, exact)
        assert bound <= exact * (1 + 1e-6) + slack / 2, (trial, bound, exact)  # the values below the cut: half the slack
        settled += top_p * bound * (1 + 1e-6) <= 1.0
        if exact <= 1 + 0.45 * slack:  # settled by a clear margin: the bound settles it too
            assert top_p * bound * (1 + 1e-6) <= 1.0, (trial, bound, exact)
    assert settled > 50
