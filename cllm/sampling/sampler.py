"""Batched sampler: one row of logits per sequence -> one token (and logprobs) each.

Processing order per row: logit_bias, penalties, min_tokens suppression,
(logprobs are taken here, before temperature), then greedy argmax or
temperature -> top_k -> top_p -> min_p -> draw. Elementwise steps run over the
whole batch with numpy; the draw uses one uniform number from each request's
own generator (inverse CDF), so a seeded request gives the same tokens whatever
its batch-mates are.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cllm.sampling.params import SamplingParams

# A nucleus is found among the top NUCLEUS_CANDIDATES tokens when they hold the
# needed mass (almost always), avoiding a full-vocabulary sort per row.
NUCLEUS_CANDIDATES = 256
# Strided groups whose maxima bound a row's k-th largest logit (top_candidates); 2048 groups
# keep the bound within a few times k of the truth for real vocabularies (32k-256k).
CANDIDATE_GROUPS = 2048


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams  # the request's settings
    rng: np.random.Generator  # the request's own generator
    prompt_token_ids: Sequence[int]  # for the repetition penalty
    output_token_ids: Sequence[int]  # for all penalties and min_tokens
    stop_ids: frozenset[int]  # EOS + stop_token_ids (suppressed before min_tokens)


@dataclass(slots=True)
class SampledToken:
    """One row's result."""

    token_id: int  # the chosen token
    logprob: float | None  # its logprob (when asked)
    top_ids: list[int]  # top-k alternatives (when asked)
    top_logprobs: list[float]  # their logprobs


def sample(logits: np.ndarray, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of ``logits`` (modified in place)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sequences")
    _apply_biases_and_penalties(logits, rows)
    logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = _log_softmax(logits[logprob_rows]) if logprob_rows else None
    chosen = np.empty(len(rows), dtype=np.int64)
    greedy = np.array([r.params.greedy for r in rows], dtype=bool)
    if greedy.all():
        return _results(logits.argmax(axis=1), rows, logprob_rows, logprobs)
    if greedy.any():
        chosen[greedy] = logits[greedy].argmax(axis=1)
    stochastic = np.flatnonzero(~greedy)
    if len(stochastic) == len(rows):  # no fancy-index copy of the whole batch's logits
        chosen[:] = _draw(logits, rows)
    elif len(stochastic):
        chosen[stochastic] = _draw(logits[stochastic], [rows[i] for i in stochastic])
    return _results(chosen, rows, logprob_rows, logprobs)


def _apply_biases_and_penalties(logits: np.ndarray, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
            logits[i, ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
    _apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
            _suppress_stop(logits[i], list(row.stop_ids))


def _suppress_stop(row: np.ndarray, stop_ids: list[int]) -> None:
    """min_tokens: no stop token yet, unless a grammar allows nothing else (then it must end)."""
    saved = row[stop_ids].copy()
    row[stop_ids] = -np.inf
    if not np.isfinite(row).any():
        row[stop_ids] = saved


def _apply_penalties(logits: np.ndarray, rows: Sequence[SamplingRow]) -> None:
    """Repetition, presence and frequency penalties for the whole batch in two vectorised passes:
    (row, token) pairs are keyed row * vocab + token, so one np.unique serves every row."""
    vocab = logits.shape[1]
    seen = [i * vocab + np.asarray(seq, dtype=np.int64) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
            for seq in (r.prompt_token_ids, r.output_token_ids) if len(seq)]
    if seen:
        keys = np.unique(np.concatenate(seen))
        r, t = np.divmod(keys, vocab)
        penalty = np.array([r_.params.repetition_penalty for r_ in rows], dtype=np.float32)[r]
        vals = logits[r, t]
        logits[r, t] = np.where(vals > 0, vals / penalty, vals * penalty)
    additive = [i for i, r in enumerate(rows)
                if len(r.output_token_ids) and (r.params.presence_penalty or r.params.frequency_penalty)]
    if additive:
        keys, counts = np.unique(np.concatenate([
            i * vocab + np.asarray(rows[i].output_token_ids, dtype=np.int64) for i in additive]), return_counts=True)
        r, t = np.divmod(keys, vocab)
        freq = np.array([r_.params.frequency_penalty for r_ in rows], dtype=np.float32)[r]
        presence = np.array([r_.params.presence_penalty for r_ in rows], dtype=np.float32)[r]
        logits[r, t] -= freq * counts + presence


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _draw(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    """One token per row. Rows that truncate (top_k, top_p, min_p) are drawn from their top
    candidates only (no full-vocabulary softmax, sort or cumsum); the rest, and any row whose
    candidates turn out too few, take the full-distribution path."""
    vocab = logits.shape[1]
    chosen = np.empty(len(rows), dtype=np.int64)
    full: list[int] = []
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(_num_candidates(row.params, vocab), []).append(i)
    for k, members in groups.items():
        if k == 0:
            full += members
            continue
        sub = logits if len(members) == len(rows) else logits[members]
        for i, ids in zip(members, top_candidates(sub, k)):
            token = _draw_from_candidates(logits[i], ids, rows[i], vocab)
            if token is None:
                full.append(i)
            else:
                chosen[i] = token
    if full:
        full.sort()
        chosen[full] = _draw_full(logits[full], [rows[i] for i in full])
    return chosen


def _num_candidates(p: SamplingParams, vocab: int) -> int:
    """How many top tokens a row can be drawn from; 0 = it needs the whole distribution."""
    if p.top_k and p.top_k < vocab:
        return p.top_k
    if p.top_p < 1.0 or p.min_p > 0:
        return min(NUCLEUS_CANDIDATES, vocab)
    return 0


def top_candidates(logits: np.ndarray, k: int) -> list[np.ndarray]:
    """Per row, the ids of its k largest logits, largest first, ties by lower id (so a row's
    candidates never depend on its batch-mates).

    A lower bound on each row's k-th largest value comes from a cheap elementwise max over
    strided groups (at least k groups reach their max, so at least k values lie above it);
    only the few values above it are sorted.
    """
    bounds = _kth_lower_bounds(logits, k)
    out = []
    for i, row in enumerate(logits):
        ids = np.flatnonzero(row >= bounds[i]) if bounds is not None else np.argpartition(row, -k)[-k:]
        if bounds is None:  # argpartition picks arbitrarily among ties: add every tie of the k-th value
            ids = np.flatnonzero(row >= row[ids].min())
        order = np.lexsort((ids, -row[ids]))[:k]
        out.append(ids[order])
    return out


def _kth_lower_bounds(logits: np.ndarray, k: int) -> np.ndarray | None:
    """For each row, a value with at least k of the row's logits >= it; None when the vocabulary
    is too small for groups to pay off."""
    n, vocab = logits.shape
    groups = max(CANDIDATE_GROUPS, 2 * k)
    if vocab < 4 * groups:
        return None
    logits = np.ascontiguousarray(logits)
    per_group = vocab // groups
    size = logits.itemsize
    # (row, member, group) view: group g of a row holds columns g, g + groups, ...; its max over
    # members is one elementwise pass over contiguous memory (the tail beyond groups*per_group
    # is left out, which only lowers the bound's need: those values are still candidates).
    view = np.lib.stride_tricks.as_strided(logits, (n, per_group, groups), (logits.strides[0], groups * size, size))
    group_max = view.max(axis=1)
    return np.partition(group_max, groups - k, axis=1)[:, groups - k]


def _draw_from_candidates(row_logits: np.ndarray, ids: np.ndarray, row: SamplingRow, vocab: int) -> int | None:
    """min_p -> top_k -> top_p over the row's top candidates, then the inverse-CDF draw (largest
    first); None (and no random number used) when the candidates cannot hold the answer."""
    p = row.params
    weights = np.exp((row_logits[ids].astype(np.float64) - float(row_logits[ids[0]])) / p.temperature)
    complete = bool(p.top_k and p.top_k < vocab) or len(ids) >= vocab  # every kept token is a candidate
    if p.min_p > 0:
        above = int(np.count_nonzero(weights >= p.min_p))  # weights are p / p(max)
        if above == len(weights) and not complete:
            return None  # more tokens may pass min_p beyond the candidates
        weights, complete = weights[:above], True
    if p.top_p < 1.0:
        total = float(weights.sum()) if complete else _partition_sum(row_logits, p.temperature)
        cum = np.cumsum(weights)
        if cum[-1] < p.top_p * total:
            return None  # a very flat distribution: the nucleus reaches beyond the candidates
        weights = weights[: int(np.searchsorted(cum, p.top_p * total)) + 1]
    cum = np.cumsum(weights)
    picked = int(np.count_nonzero(cum < row.rng.random() * cum[-1]))
    return int(ids[min(picked, len(ids) - 1)])


def _partition_sum(row_logits: np.ndarray, temperature: float) -> float:
    """sum(exp((logits - max) / T)) over the whole vocabulary: the softmax denominator relative
    to the top token's weight of 1."""
    z = (row_logits - row_logits.max()) / np.float32(temperature)
    np.exp(z, out=z)
    return float(z.sum(dtype=np.float64))


def _draw_full(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    """Inverse-CDF draw over the whole vocabulary, in id order (rows without truncation)."""
    temps = np.array([r.params.temperature for r in rows], dtype=np.float32)[:, None]
    scaled = logits / temps
    scaled -= scaled.max(axis=1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=1, keepdims=True)
    for i, row in enumerate(rows):
        _truncate(probs[i], row.params)
    probs /= probs.sum(axis=1, keepdims=True)
    u = np.array([r.rng.random() for r in rows])[:, None]
    cdf = np.cumsum(probs, axis=1)
    picked = (cdf < u * cdf[:, -1:]).sum(axis=1)
    return np.minimum(picked, logits.shape[1] - 1)


def _truncate(probs: np.ndarray, p: SamplingParams) -> None:
    """Zero the tokens outside top_k / top_p / min_p, in place (probs sum to 1 on entry)."""
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0.0
    if p.top_k and p.top_k < len(probs):
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs[probs < kth] = 0.0
    if p.top_p < 1.0:
        _nucleus(probs, p.top_p * probs.sum())


def _nucleus(probs: np.ndarray, mass: float) -> None:
    k = min(NUCLEUS_CANDIDATES, len(probs))
    top = np.argpartition(probs, -k)[-k:]
    order = top[np.argsort(-probs[top], kind="stable")]
    cum = np.cumsum(probs[order])
    if cum[-1] < mass and k < len(probs):  # rare: a very flat distribution
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
    keep = int(np.searchsorted(cum, mass)) + 1  # smallest set reaching the mass
    mask = np.zeros(len(probs), dtype=bool)
    mask[order[:keep]] = True
    probs[~mask] = 0.0


def _results(chosen: np.ndarray, rows: Sequence[SamplingRow], logprob_rows: list[int],
             logprobs: np.ndarray | None) -> list[SampledToken]:
    out = [SampledToken(int(t), None, [], []) for t in chosen]
    for j, i in enumerate(logprob_rows):
        lp = logprobs[j]  # type: ignore[index]
        res = out[i]
        res.logprob = float(lp[res.token_id])
        k = rows[i].params.logprobs or 0
        if k:
            top = np.argpartition(lp, -k)[-k:]
            top = top[np.argsort(-lp[top], kind="stable")]
            top = [t for t in top if np.isfinite(lp[t])]  # a grammar's masked tokens are no alternatives
            res.top_ids = [int(t) for t in top]
            res.top_logprobs = [float(lp[t]) for t in top]
    return out
