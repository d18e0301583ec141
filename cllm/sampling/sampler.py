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
    if len(stochastic):
        chosen[stochastic] = _draw(logits[stochastic], [rows[i] for i in stochastic])
    return _results(chosen, rows, logprob_rows, logprobs)


def _apply_biases_and_penalties(logits: np.ndarray, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
            logits[i, ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
        if p.has_penalties:
            _apply_penalties(logits[i], p, row.prompt_token_ids, row.output_token_ids)
        if len(row.output_token_ids) < p.min_tokens and row.stop_ids:
            _suppress_stop(logits[i], list(row.stop_ids))


def _suppress_stop(row: np.ndarray, stop_ids: list[int]) -> None:
    """min_tokens: no stop token yet, unless a grammar allows nothing else (then it must end)."""
    saved = row[stop_ids].copy()
    row[stop_ids] = -np.inf
    if not np.isfinite(row).any():
        row[stop_ids] = saved


def _apply_penalties(row: np.ndarray, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> None:
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt) + list(output), dtype=np.int64))
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _draw(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
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
