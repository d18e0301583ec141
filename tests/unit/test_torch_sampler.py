"""The torch sampler against the numpy one, on CPU tensors (the same code runs on CUDA tensors).

What is guaranteed: the same processing and the same random stream (one uniform
per sampled row from the request's own generator), so greedy picks and logprobs
agree up to float rounding, and seeded draws pick the same token except when
the uniform lies within rounding of a CDF boundary — which the check below
measures instead of assuming it never happens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cllm.sampling import sampler as np_sampler
from cllm.sampling import torch_sampler
from cllm.sampling.params import SamplingParams
from cllm.sampling.sampler import SamplingRow

VOCAB = 512
STOP = frozenset({3, 7})
BOUNDARY_TOL = 1e-5  # float32 CDF rounding at this vocab size is ~1e-7; a mismatch must sit this close


def make_rows(params: list[SamplingParams], seeds: list[int], outputs: list[list[int]]) -> list[SamplingRow]:
    return [SamplingRow(p, np.random.default_rng(s), [1, 2, 5, 5], out, STOP) for p, s, out in zip(params, seeds, outputs)]


def both(logits: np.ndarray, params: list[SamplingParams], seeds: list[int], outputs: list[list[int]]):
    """(numpy results, torch results, the uniforms both drew) on copies of the same logits."""
    ref = np_sampler.sample(logits.copy(), make_rows(params, seeds, outputs))
    got = torch_sampler.sample(torch.from_numpy(logits.copy()), make_rows(params, seeds, outputs))
    return ref, got


def penalised_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={11: 4.0, 12: -100.0}),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(temperature=0, min_tokens=5),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0, logprobs=0, repetition_penalty=0.8),
    ]


def test_greedy_with_bias_penalties_min_tokens_and_logprobs_matches_numpy():
    rng = np.random.default_rng(0)
    params = penalised_params()
    for step in range(10):
        logits = rng.normal(scale=3.0, size=(len(params), VOCAB)).astype(np.float32)
        logits[3, 3] = 50.0  # a stop token min_tokens must hold back
        outputs = [list(rng.integers(0, VOCAB, size=step)) for _ in params]
        ref, got = both(logits, params, list(range(len(params))), outputs)
        assert [r.token_id for r in got] == [r.token_id for r in ref]
        # the stop id holds the top logit: masked while fewer than min_tokens=5 outputs, picked after
        assert (got[3].token_id == 3) == (step >= 5)
        for r, g in zip(ref, got):
            assert (g.logprob is None) == (r.logprob is None)
            if r.logprob is not None:
                assert g.logprob == pytest.approx(r.logprob, abs=1e-4)
                assert g.top_ids == r.top_ids
                assert np.allclose(g.top_logprobs, r.top_logprobs, atol=1e-4)
        assert len(got[4].top_ids) == 3 and not got[5].top_ids


def test_bias_and_penalties_change_the_pick_as_numpy_does():
    logits = np.zeros((3, VOCAB), dtype=np.float32)
    logits[:, 20], logits[:, 21] = 2.0, 1.9
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, repetition_penalty=1.2),
              SamplingParams(temperature=0, logit_bias={22: 5.0})]
    ref, got = both(logits, params, [0, 0, 0], [[20], [20], []])
    assert [g.token_id for g in got] == [r.token_id for r in ref] == [21, 21, 22]


def seeded_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=20, seed=2),
        SamplingParams(temperature=1.3, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, seed=5),
        SamplingParams(temperature=0),  # greedy row between sampled ones consumes no uniform
        SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.3, logit_bias={9: 2.0}, seed=6),
        SamplingParams(temperature=0.8, min_tokens=3, logprobs=2, seed=7),
    ]


def cdf_distance(logits: np.ndarray, rows: list[SamplingRow], i: int, u: float) -> float:
    """Distance of u to the nearest CDF boundary of row i's final distribution, in float64, walked as
    both samplers walk it: kept tokens largest first when the row truncates, else in id order."""
    x = logits[i : i + 1].copy()
    np_sampler._apply_biases_and_penalties(x, rows[i : i + 1])
    p = rows[i].params
    scaled = x[0].astype(np.float64) / p.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    kept = probs.astype(np.float32)
    np_sampler._truncate(kept, p)
    if torch_sampler._truncates(p, len(probs)):
        ids = np.flatnonzero(kept > 0)
        walk = probs[ids[np.lexsort((ids, -probs[ids]))]]
    else:
        walk = probs
    cdf = np.cumsum(walk)
    cdf /= cdf[-1]
    return float(np.min(np.abs(cdf - u)))


def test_seeded_draws_match_numpy_except_within_rounding_of_a_boundary():
    rng = np.random.default_rng(42)
    params = seeded_params()
    seeds = [p.seed or 0 for p in params]
    np_rows, t_rows = make_rows(params, seeds, [[] for _ in params]), make_rows(params, seeds, [[] for _ in params])
    mismatches, total = 0, 0
    for step in range(40):
        logits = rng.normal(scale=2.0, size=(len(params), VOCAB)).astype(np.float32)
        outputs = [list(rng.integers(0, VOCAB, size=step % 5)) for _ in params]
        for r_np, r_t, out in zip(np_rows, t_rows, outputs):
            r_np.output_token_ids = r_t.output_token_ids = out
        # generator states before the step, to recover the uniform a mismatching row drew
        states = [r.rng.bit_generator.state for r in np_rows]
        ref = np_sampler.sample(logits.copy(), np_rows)
        got = torch_sampler.sample(torch.from_numpy(logits.copy()), t_rows)
        for i, (r, g) in enumerate(zip(ref, got)):
            total += 1
            if r.token_id != g.token_id:
                probe = np.random.default_rng()
                probe.bit_generator.state = states[i]
                u = probe.random()
                assert cdf_distance(logits, np_rows, i, u) < BOUNDARY_TOL, (step, i, r.token_id, g.token_id)
                mismatches += 1
        # both samplers drew the same number of uniforms: the generators are still in step
        assert [r.rng.bit_generator.state for r in np_rows] == [r.rng.bit_generator.state for r in t_rows]
    assert mismatches <= total // 100


def test_seeded_row_draws_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    alone = torch_sampler.sample(torch.from_numpy(logits[2:3].copy()), make_rows([target], [11], [[]]))[0]
    mates = [SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=0), target, SamplingParams(temperature=2.0, top_k=3)]
    batch = torch_sampler.sample(torch.from_numpy(logits.copy()), make_rows(mates, [1, 2, 11, 4], [[]] * 4))
    assert batch[2].token_id == alone.token_id


def test_frequencies_follow_the_truncated_softmax():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    n = 3000
    gen = np.random.default_rng(1)

    def draw(p: SamplingParams) -> np.ndarray:
        rows = [SamplingRow(p, gen, [], [], frozenset()) for _ in range(n)]
        return np.array([s.token_id for s in torch_sampler.sample(torch.from_numpy(np.repeat(logits[None], n, axis=0)), rows)])

    freq = np.bincount(draw(SamplingParams(temperature=1.0)), minlength=4) / n
    assert np.allclose(freq, [0.4, 0.3, 0.2, 0.1], atol=0.03)
    assert set(draw(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.65))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.6))) == {0, 1}
    freq = np.bincount(draw(SamplingParams(temperature=1.0, top_k=2)), minlength=4) / n
    assert np.allclose(freq[:2], [0.4 / 0.7, 0.3 / 0.7], atol=0.03)


def test_chosen_ids_stay_on_the_logits_device():
    logits = torch.randn(3, VOCAB)
    rows = make_rows([SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0, logprobs=1)],
                     [0, 1, 2], [[], [], []])
    out = torch_sampler.sample_on_device(logits, rows)
    assert out.token_ids.device == logits.device and out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == [r.token_id for r in out.results()]


@pytest.mark.parametrize("shape, dtype, text", [((2, VOCAB), torch.float32, "for 3 sequences"),
                                               ((3, VOCAB), torch.float16, "float16")])
def test_bad_logits_are_a_value_error(shape, dtype, text):
    rows = make_rows([SamplingParams(temperature=0)] * 3, [0, 1, 2], [[], [], []])
    with pytest.raises(ValueError, match=text):
        torch_sampler.sample(torch.zeros(shape, dtype=dtype), rows)


def test_min_tokens_yields_when_a_grammar_allows_only_a_stop_token():
    logits = np.full((2, VOCAB), -np.inf, dtype=np.float32)
    logits[0, 3] = 1.0  # only the stop token is allowed: it must be taken despite min_tokens
    logits[1, [3, 40]] = [5.0, 1.0]  # another token is allowed: the stop token is held back
    params = [SamplingParams(temperature=0, min_tokens=4), SamplingParams(temperature=0, min_tokens=4)]
    ref, got = both(logits, params, [0, 1], [[], []])
    assert [g.token_id for g in got] == [r.token_id for r in ref] == [3, 40]


def test_cpu_candidate_tiers_draw_exactly_what_the_whole_sort_draws(monkeypatch):
    """The CPU's cut from top candidates (64, then 512; the top token alone where it holds top_p of the mass)
    against the stable sort of every row: the same token for every row, including rows whose kept tokens
    do not fit the candidates (a flat distribution, a tie across the last candidate), which must fall
    through to the next tier."""
    vocab, rng = 8192, np.random.default_rng(5)
    logits = rng.normal(scale=4.0, size=(12, vocab)).astype(np.float32)
    logits[1] = rng.normal(scale=0.1, size=vocab)  # flat: its nucleus holds thousands of tokens
    logits[2, :] = -np.inf
    logits[2, [5, 900, 4000]] = [1.0, 1.0, 0.5]  # a grammar's three allowed tokens, two tied
    logits[3, :200] = 30.0  # 200 tied above the rest: a tie across the 64th candidate; the nucleus is ids 0-19
    logits[4, 7000:7100] = 40.0  # 100 tied at the top, nucleus among them
    logits[9, 4321] = 40.0  # a nucleus of one token
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.1),
              SamplingParams(temperature=1.0, top_k=80, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.3),
              SamplingParams(temperature=2.0, min_p=0.01), SamplingParams(temperature=0.8, top_k=40),
              SamplingParams(temperature=1.2, top_k=200, min_p=0.02, top_p=0.97), SamplingParams(temperature=0.5, top_p=0.99),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=3.0, top_p=0.6)]
    for draw in range(20):
        seeds = [draw * 100 + i for i in range(len(params))]
        tiered = torch_sampler.sample(torch.from_numpy(logits.copy()), make_rows(params, seeds, [[]] * len(params)))
        with monkeypatch.context() as m:
            m.setattr(torch_sampler, "CANDIDATE_TIERS", ())
            whole = torch_sampler.sample(torch.from_numpy(logits.copy()), make_rows(params, seeds, [[]] * len(params)))
        assert [t.token_id for t in tiered] == [w.token_id for w in whole]
        assert tiered[2].token_id in (5, 900, 4000) and tiered[3].token_id < 20 and 7000 <= tiered[4].token_id < 7100
        assert tiered[9].token_id == 4321


def test_cpu_candidate_tiers_fall_through_where_the_kept_tokens_do_not_fit():
    """A flat row (its nucleus is wider than 64) and a tie across the 64th candidate (which tied ids topk
    took is its own choice) are redone at the next tier; a peaked row is exact from its 64."""
    vocab = 8192
    logits = np.random.default_rng(2).normal(scale=0.1, size=(3, vocab)).astype(np.float32)
    logits[1, :200] = 30.0
    probs = torch.softmax(torch.from_numpy(logits), dim=1)
    probs[2] = torch.softmax(torch.arange(vocab, dtype=torch.float32) * -0.5, dim=0)  # peaked
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.1),
              SamplingParams(temperature=1.0, top_p=0.9)]
    settings = torch_sampler.table_for(probs.device, vocab).settings(make_rows(params, [0, 1, 2], [[]] * 3))
    _, exact = torch_sampler._candidate_draw(probs, settings, torch.full((3, 1), 0.5), 64)
    assert exact.tolist() == [False, False, True]


def test_the_sampling_table_keeps_a_slot_per_live_row_and_gives_it_back():
    """The persistent settings (issue 41 §3): a row's settings are written into a slot once and gathered from
    there; a dead row's slot goes to the next new row, whose settings then reach the device copy; growing
    the table keeps every live row's; a row sampled at another vocabulary moves there."""
    table = torch_sampler.SamplingTable(torch.device("cpu"), VOCAB, capacity=2)
    a = make_rows([SamplingParams(temperature=0.5, top_p=0.9)], [1], [[]])[0]
    b = make_rows([SamplingParams(temperature=0)], [2], [[]])[0]
    s = table.settings([a, b])
    assert (a.slot, b.slot) == (0, 1) and a.table is table
    assert s.device("temperature").tolist() == [0.5, 0.0] and s.draw.tolist() == [np_sampler.WIDE, np_sampler.GREEDY]
    del b
    c = make_rows([SamplingParams(temperature=1.5, top_k=7, min_p=0.25)], [3], [[]])[0]
    s = table.settings([c, a])
    assert c.slot == 1  # the dead row's
    assert s.device("temperature").tolist() == [1.5, 0.5] and s.device("min_p").tolist() == [0.25, 0.0]
    assert s.top_k.tolist() == [7, VOCAB] and s.device("top_k").tolist() == [7, VOCAB]
    assert s.draw.tolist() == [7, np_sampler.WIDE]
    more = make_rows([SamplingParams(temperature=0.1 * (i + 1), top_p=0.5) for i in range(5)], list(range(5)), [[]] * 5)
    s = table.settings([a, *more, c])  # past the capacity of 2
    assert s.device("temperature").tolist() == pytest.approx([0.5, 0.1, 0.2, 0.3, 0.4, 0.5, 1.5])
    assert s.device("top_p").tolist() == pytest.approx([0.9, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0])
    assert len({r.slot for r in [a, *more, c]}) == 7
    other = torch_sampler.SamplingTable(torch.device("cpu"), 2 * VOCAB)
    assert other.settings([c]).top_k.tolist() == [7] and c.table is other
    d = make_rows([SamplingParams(temperature=0.7)], [4], [[]])[0]
    assert table.settings([d]).device("temperature").tolist() == pytest.approx([0.7]) and d.slot == 1  # c's, given back


def test_seeded_draws_do_not_depend_on_which_slots_the_rows_hold():
    """The same rows, placed in the table in another order and beside other rows, draw the same tokens."""
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=2.0, size=(4, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.1, top_k=20),
              SamplingParams(temperature=0), SamplingParams(temperature=0.6, min_p=0.1)]
    first = torch_sampler.sample(torch.from_numpy(logits.copy()), make_rows(params, [1, 2, 3, 4], [[]] * 4))
    others = make_rows([SamplingParams(temperature=2.0, top_p=0.3)] * 9, list(range(9)), [[]] * 9)
    torch_sampler.sample(torch.from_numpy(rng.normal(size=(9, VOCAB)).astype(np.float32)), others)
    rows = make_rows(params[::-1], [4, 3, 2, 1], [[]] * 4)
    again = torch_sampler.sample(torch.from_numpy(logits[::-1].copy()), rows)
    assert [t.token_id for t in again[::-1]] == [t.token_id for t in first]


def test_the_sampling_table_gives_each_row_its_own_stream_of_numbers_in_order():
    """A row's numbers, taken a batch at a time from the table, one by one, after a move to another table,
    and past a draw ahead, are its generator's stream in order; ``rng`` is positioned after the used ones."""
    seed, ahead = 11, np_sampler.UNIFORMS_AHEAD
    stream = np.random.default_rng(seed).random(3 * ahead)
    row, other = make_rows([SamplingParams(temperature=1.0)] * 2, [seed, 12], [[], []])
    got = [row.uniform() for _ in range(3)]  # before the row is in a table
    table = torch_sampler.SamplingTable(torch.device("cpu"), VOCAB)
    for _ in range(ahead):  # past its first draw ahead, beside another row
        got.append(float(table.uniforms([other, row], table.settings([other, row]))[1]))
    got.append(row.uniform())
    moved = torch_sampler.SamplingTable(torch.device("cpu"), 2 * VOCAB)
    got += table_draws(moved, [row], 2)
    assert got == stream[:len(got)].tolist()
    assert row.rng.random() == stream[len(got)]  # and the next one
    assert row.uniform() == stream[len(got) + 1]
    twice = moved.uniforms([row, row], moved.settings([row, row]))  # one row twice: one number after the other
    assert twice.tolist() == stream[len(got) + 2:len(got) + 4].tolist()


def table_draws(table: torch_sampler.SamplingTable, rows: list[SamplingRow], steps: int) -> list[float]:
    return [float(table.uniforms(rows, table.settings(rows))[0]) for _ in range(steps)]
