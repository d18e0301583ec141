"""Batched sampler: one row of logits per sequence -> one token (and logprobs) each.

Processing order per row: logit_bias, penalties, min_tokens suppression,
(logprobs are taken here, before temperature), then greedy argmax or
temperature -> top_k -> top_p -> min_p -> draw. Elementwise steps run over the
whole batch with numpy; the draw uses one uniform number from each request's
own generator (inverse CDF), so a seeded request gives the same tokens whatever
its batch-mates are.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cllm.sampling.params import SamplingParams

# A nucleus is found among the top NUCLEUS_CANDIDATES tokens when they hold the
# needed mass (almost always), avoiding a full-vocabulary sort per row.
NUCLEUS_CANDIDATES = 256
# Strided groups whose maxima bound a row's k-th largest logit (top_candidates); 4096 groups
# keep the bound within a few times k of the truth for real vocabularies (32k-256k).
CANDIDATE_GROUPS = 4096
# Values (rows x vocabulary) per block of _softmax_totals: 256 KiB of float32, within a core's L2.
TOTALS_BLOCK_VALUES = 65536
# Up to this many rows, per-row Python floats beat the batch's array set-up (_single_token_nucleus).
FEW_ROWS = 4
# Up to this many values above _near_bound's cut are summed in Python floats (fewer calls than numpy's).
NEAR_IN_PYTHON = 16
# Random numbers drawn from a request's generator at a time (SamplingRow.uniform).
UNIFORMS_AHEAD = 64


GREEDY = -1  # SamplingRow.draw: the row takes its argmax
WIDE = -2  # SamplingRow.draw: a nucleus over the whole vocabulary's mass (_single_token_nuclei)


class SamplingRow:
    """What the sampler needs of one sequence this step (``SamplingRow(params, rng, prompt_token_ids,
    output_token_ids, stop_ids)``). What it makes of ``params`` (fixed for a request) is found once, not
    every step: reading a dozen settings per row and step was a third of a 256-row sampling call."""

    __slots__ = ("params", "_rng", "prompt_token_ids", "output_token_ids", "stop_ids", "adjusted", "draw_vocab",
                 "draw", "plain", "_ahead", "_rewind", "table", "slot")

    def __init__(self, params: SamplingParams, rng: np.random.Generator | int, prompt_token_ids: Sequence[int],
                 output_token_ids: Sequence[int], stop_ids: frozenset[int]) -> None:
        self.params = params  # the request's settings
        # the request's own generator (``rng``: positioned after the numbers used); given as its seed (an int)
        # it is made on first use: ~10 µs a request, and a greedy one never draws
        self._rng: np.random.Generator | int = rng
        self.prompt_token_ids = prompt_token_ids  # for the repetition penalty
        self.output_token_ids = output_token_ids  # for all penalties and min_tokens
        self.stop_ids = stop_ids  # EOS + stop_token_ids (suppressed before min_tokens)
        # logit_bias, a penalty, min_tokens or logprobs: the row takes the per-setting pass
        p = params
        self.adjusted = bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                             or p.logprobs is not None or (p.min_tokens and stop_ids))
        self.plain = p.temperature == 0.0 and not self.adjusted  # its argmax, nothing else
        # How the row draws over a vocabulary of draw_vocab tokens (0: not found yet): GREEDY, WIDE,
        # or from its top k candidates (k > 0), or the whole distribution (0).
        self.draw_vocab = 0
        self.draw = 0
        self._ahead: list[float] = []  # numbers drawn ahead from the generator, not used yet (last first)
        self._rewind: dict | None = None  # the generator's state before the last UNIFORMS_AHEAD were drawn
        # the torch sampler's SamplingTable holding this row's settings, and its slot there (while the row lives)
        self.table: Any = None
        self.slot = -1

    def __del__(self) -> None:
        if self.table is not None:
            self.table.free(self.slot)

    def uniform(self) -> float:
        """The request's next random number in [0, 1): exactly what ``rng.random()`` would return, drawn
        UNIFORMS_AHEAD at a time (one generator call per row and step was a twentieth of a 256-row step;
        ``Generator.random(n)`` yields the same stream as n single calls). While the row is in a
        SamplingTable, the numbers drawn ahead are kept there (the torch sampler takes a batch's at once)."""
        if self.table is not None:
            return self.table.uniform(self)
        ahead = self._ahead
        if not ahead:
            ahead.extend(self.draw_ahead()[::-1].tolist())
        return ahead.pop()

    def draw_ahead(self) -> np.ndarray:
        """The generator's next UNIFORMS_AHEAD numbers (its state before them kept, for ``rng``)."""
        rng = self._generator()
        self._rewind = rng.bit_generator.state
        return rng.random(UNIFORMS_AHEAD)

    def take_ahead(self) -> list[float]:
        """The numbers drawn ahead and not used yet, in order, handed over (to a SamplingTable)."""
        ahead = self._ahead[::-1]
        self._ahead.clear()
        return ahead

    def _generator(self) -> np.random.Generator:
        if isinstance(self._rng, int):
            self._rng = np.random.default_rng(self._rng)
        return self._rng

    @property
    def rng(self) -> np.random.Generator:
        """The request's generator, positioned right after the numbers used (what was drawn ahead is
        given back), e.g. to save its state."""
        rng = self._generator()
        unused = len(self.take_ahead()) if self.table is None else self.table.drop_ahead(self.slot)
        if unused:
            rng.bit_generator.state = self._rewind
            rng.random(UNIFORMS_AHEAD - unused)  # the ones used
        return rng

    def draw_for(self, vocab: int) -> int:
        """``draw`` for a vocabulary of ``vocab`` tokens (found on first use)."""
        if self.draw_vocab != vocab:
            p = self.params
            nucleus_k = min(NUCLEUS_CANDIDATES, vocab)
            if p.temperature == 0.0:
                self.draw = GREEDY
            elif p.top_k and p.top_k < vocab:
                self.draw = p.top_k
            elif p.top_p < 1.0 and p.min_p <= 0 and nucleus_k < vocab:
                self.draw = WIDE
            else:
                self.draw = nucleus_k if p.top_p < 1.0 or p.min_p > 0 else 0
            self.draw_vocab = vocab
        return self.draw


def uniforms(rows: Sequence[SamplingRow]) -> list[float]:
    """Each row's ``uniform()``: the number drawn ahead taken here, the call made only to draw more (a
    method call per row was half of it)."""
    return [r._ahead.pop() if r._ahead else r.uniform() for r in rows]


@dataclass(slots=True)
class SampledToken:
    """One row's result."""

    token_id: int  # the chosen token
    logprob: float | None  # its logprob (when asked)
    top_ids: Sequence[int]  # top-k alternatives (when asked)
    top_logprobs: Sequence[float]  # their logprobs


NO_ALTERNATIVES: tuple = ()  # top_ids / top_logprobs of a row that asked for none (shared, immutable)


def sample(logits: np.ndarray, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of ``logits`` (modified in place)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sequences")
    plan = _apply_biases_and_penalties(logits, rows)
    logprobs = _log_softmax(logits[plan.logprob_rows]) if plan.logprob_rows else None
    if len(plan.greedy) == len(rows):
        return _results(logits.argmax(axis=1), rows, plan.logprob_rows, logprobs)
    chosen = np.empty(len(rows), dtype=np.int64)
    if plan.greedy:
        chosen[plan.greedy] = logits[plan.greedy].argmax(axis=1)
    _draw(logits, rows, plan, chosen)
    return _results(chosen, rows, plan.logprob_rows, logprobs)


@dataclass(slots=True)
class _Plan:
    """What each row needs this step, found in one pass over the rows (a pass per question, and a
    function call per row and pass, was a tenth of a 256-row step)."""

    logprob_rows: list[int] = field(default_factory=list)  # rows that want logprobs
    greedy: list[int] = field(default_factory=list)  # rows that take their argmax
    # Rows whose nucleus is a share of the whole vocabulary's mass (top_p without a top_k or min_p
    # cut): the top token alone often holds it (_single_token_nuclei).
    wide: list[int] = field(default_factory=list)
    # The other drawn rows by how many top candidates they draw from (0: the whole distribution).
    groups: dict[int, list[int]] = field(default_factory=dict)


def _apply_biases_and_penalties(logits: np.ndarray, rows: Sequence[SamplingRow]) -> _Plan:
    """logit_bias, penalties and min_tokens' suppression of stop tokens, in that order; returns what
    each row needs next (logprobs, argmax, or which kind of draw)."""
    vocab = logits.shape[1]
    plan = _Plan()
    penalised = False
    suppressed: list[int] = []
    for i, row in enumerate(rows):
        if row.adjusted:
            p = row.params
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
                logits[i, ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                penalised = True
            if p.min_tokens and row.stop_ids and len(row.output_token_ids) < p.min_tokens:
                suppressed.append(i)
            if p.logprobs is not None:
                plan.logprob_rows.append(i)
        draw = row.draw if row.draw_vocab == vocab else row.draw_for(vocab)
        if draw == GREEDY:
            plan.greedy.append(i)
        elif draw == WIDE:
            plan.wide.append(i)
        else:
            plan.groups.setdefault(draw, []).append(i)
    if penalised:
        _apply_penalties(logits, rows)
    for i in suppressed:
        _suppress_stop(logits[i], list(rows[i].stop_ids))
    return plan


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
        keys, _ = np.unique(np.concatenate(seen), return_counts=True)  # sort-based: numpy 2.4's unique
        # without counts hashes, ~8x slower on these ~10k keys
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


def _draw(logits: np.ndarray, rows: Sequence[SamplingRow], plan: _Plan, chosen: np.ndarray) -> None:
    """One token for each row the plan draws, into ``chosen``. Rows that truncate (top_k, top_p,
    min_p) are drawn from their top candidates only (no full-vocabulary softmax, sort or cumsum); the
    rest, and any row whose candidates turn out too few, take the full-distribution path. A wide
    nucleus row whose top token holds the mass by itself takes that token without looking for
    candidates."""
    vocab = logits.shape[1]
    nucleus_k = min(NUCLEUS_CANDIDATES, vocab)
    groups = plan.groups
    totals: dict[int, float] = {}  # row -> its softmax denominator (wide rows that need candidates)
    if plan.wide:
        rest = _draw_wide(logits, rows, plan.wide, chosen, totals)
        if rest:
            groups = {**groups, nucleus_k: sorted(groups.get(nucleus_k, []) + rest)}
    if not groups:
        return
    full = list(groups.get(0, []))
    for k, members in groups.items():
        if k == 0:
            continue
        sub = logits if len(members) == len(rows) else logits[members]
        row_totals = np.array([totals.get(i, np.nan) for i in members])
        tokens = _draw_from_candidates(sub, top_candidates(sub, k), [rows[i] for i in members], vocab, row_totals)
        for i, token in zip(members, tokens.tolist()):
            if token < 0:
                full.append(i)
            else:
                chosen[i] = token
    if full:
        full.sort()
        chosen[full] = _draw_full(logits[full], [rows[i] for i in full])


def _draw_wide(logits: np.ndarray, rows: Sequence[SamplingRow], wide: list[int], chosen: np.ndarray,
               totals: dict[int, float]) -> list[int]:
    """The wide nucleus rows ``wide``: their top token into ``chosen``, and one number drawn from each
    row whose top token holds the nucleus alone (the draw that picks it, as the candidates' path would
    make); returns the others, with their softmax totals put in ``totals``."""
    if len(wide) <= FEW_ROWS:  # per row, without the batch's array set-up (a third of a one-row step)
        row_totals = []
        for i in wide:
            p = rows[i].params
            chosen[i], total = _single_token_nucleus(logits, i, p.temperature, p.top_p)
            row_totals.append(total)
    else:
        params = [rows[i].params for i in wide]
        index = np.array(wide)
        chosen[index], exact = _single_token_nuclei(logits, index, np.array([p.temperature for p in params]),
                                                    np.array([p.top_p for p in params]))
        row_totals = exact.tolist()
    rest = []
    for i, total in zip(wide, row_totals):
        if total != total:  # NaN: the top token alone holds the nucleus
            rows[i].uniform()
        else:
            totals[i] = total
            rest.append(i)
    return rest


def _single_token_nucleus(logits: np.ndarray, i: int, temp: float, top_p: float) -> tuple[int, float]:
    """_single_token_nuclei for the one row ``i``, in Python floats: its top token, and NaN when that
    token alone holds the nucleus, else the row's exact total. The same bound with the same margin, and
    the same exact total, so a row gets the same answer here as in a batch (a bound only settles rows
    their exact totals would settle, sparing that sum). Between the two, a tighter bound that a batch
    does without (_near_bound): for one row it costs less than the exact sum."""
    row = logits[i]
    top = int(row.argmax())
    best = row[top]
    row[top] = -np.inf
    second = float(row[row.argmax()])  # (argmax and an index: a quarter of max's time)
    row[top] = best
    best = float(best)
    vocab = len(row)
    if top_p * (1.0 + (vocab - 1) * math.exp((second - best) / temp)) * (1 + 1e-6) <= 1.0:
        return top, math.nan
    if top_p * _near_bound(row, best, temp, top_p) * (1 + 1e-6) <= 1.0:
        return top, math.nan
    total = float(_softmax_totals(logits, np.array([i]), np.array([best]), np.array([temp]))[0])
    return top, math.nan if top_p * total <= 1.0 else total


def _near_bound(row: np.ndarray, best: float, temp: float, top_p: float) -> float:
    """An upper bound on one row's softmax total (its top logit ``best`` weighing 1): exact over the
    values at or above a cut, and each value below it counted at the cut's weight, the cut placed where
    all of those together weigh at most half of what top_p leaves beside the top token (so a row that
    is settled by a clear margin is settled by this bound). Summed in float64; the caller's 1e-6 margin
    covers the float32 exact sum's rounding as for the other bound."""
    vocab = len(row)
    share = (1.0 / top_p - 1.0) / (2 * vocab)
    if share >= 1.0:  # (top_p under 1 / (2 vocab + 1): no cut below the top token)
        return math.inf
    cut = np.float32(best + temp * math.log(share))
    near = row[row >= cut]
    far = (vocab - len(near)) * math.exp((float(cut) - best) / temp)
    if len(near) > NEAR_IN_PYTHON:
        return float(np.exp((near.astype(np.float64) - best) / temp).sum()) + far
    return sum([math.exp((v - best) / temp) for v in near.tolist()]) + far


def _single_token_nuclei(logits: np.ndarray, wide: np.ndarray, temps: np.ndarray,
                         top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the wide nucleus rows ``wide`` of ``logits`` (their temperatures and top_p): the top token of
    each (lowest id among ties), and the exact softmax total of each row whose top token does not hold
    the nucleus's mass alone (1 < top_p * total, the top token's weight being 1); NaN for the rows it
    does. The total is bounded first by 1 + (vocab - 1) * the second token's weight, which settles a
    peaked row with two passes over it; only the other rows compute their exact totals. The bound
    keeps a 1e-6 margin, more than the float32 sums' rounding, so it never answers differently from
    the exact total."""
    whole = len(wide) == len(logits)
    x = logits if whole else logits[wide]  # the rows themselves (their top values put back below), or a copy
    n, vocab = x.shape
    top = x.argmax(axis=1)
    at_top = (np.arange(n), top)
    best = x[at_top]
    x[at_top] = -np.inf
    second = x[at_top[0], x.argmax(axis=1)].astype(np.float64)  # (argmax and a gather: a third faster than max)
    x[at_top] = best
    single = top_p * (1.0 + (vocab - 1) * np.exp((second - best) / temps)) * (1 + 1e-6) <= 1.0
    totals = np.full(n, np.nan)
    if not single.all():
        unsure = np.flatnonzero(~single)
        exact = _softmax_totals(logits, wide[unsure], best[unsure], temps[unsure])
        totals[unsure] = np.where(top_p[unsure] * exact <= 1.0, np.nan, exact)
    return top, totals


def top_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Per row, the ids of its k largest logits, largest first, ties by lower id (so a row's
    candidates never depend on its batch-mates): an (n, k) array.

    A lower bound on each row's k-th largest value comes from a cheap elementwise max over
    strided groups (at least k groups reach their max, so at least k values lie above it); only
    the values at or above it are found (for small k, only in the groups whose max reaches it) and
    sorted, for the whole batch at once.
    """
    n, vocab = logits.shape
    groups = max(CANDIDATE_GROUPS, 2 * k)
    if vocab < 4 * groups:  # too small for groups to pay off: the exact k-th value, the batch at once
        bounds = np.partition(logits, vocab - k, axis=1)[:, vocab - k]
        rows, ids = np.nonzero(logits >= bounds[:, None])  # every tie of the k-th value: lower ids win below
        values = logits[rows, ids]
        order = _row_value_id_order(rows, values, ids, vocab)
        starts = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))[:-1]])
        return ids[order][starts[:, None] + np.arange(k)]
    logits = np.ascontiguousarray(logits)
    per_group = vocab // groups
    size = logits.itemsize
    # (row, member, group) view: group g of a row holds columns g, g + groups, ...; its max over
    # members is one elementwise pass over contiguous memory.
    view = np.lib.stride_tricks.as_strided(logits, (n, per_group, groups), (logits.strides[0], groups * size, size))
    group_max = view.max(axis=1)
    bounds = np.partition(group_max, groups - k, axis=1)[:, groups - k]
    if k * per_group <= vocab // 40:  # search only the groups whose max reaches the bound
        rows, ids, values = _search_groups(logits, view, group_max, bounds)
    else:  # so many groups that a strided gather (a cache miss a value) costs more than a whole-row compare
        found = [np.flatnonzero(row >= bound) for row, bound in zip(logits, bounds.tolist())]
        rows, ids = np.repeat(np.arange(n), [len(f) for f in found]), np.concatenate(found)
        values = logits[rows, ids]
    order = _row_value_id_order(rows, values, ids, vocab)
    starts = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))[:-1]])
    return ids[order][starts[:, None] + np.arange(k)]


def _search_groups(logits: np.ndarray, view: np.ndarray, group_max: np.ndarray,
                   bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, id, value) of every logit >= its row's bound, searching only the strided groups whose
    max reaches it, and the columns past the last full group."""
    _, per_group, groups = view.shape
    r, g = np.divmod(np.flatnonzero(group_max >= bounds[:, None]), groups)
    members = view[r, :, g]  # (pairs, per_group)
    pair, member = np.divmod(np.flatnonzero(members >= bounds[r, None]), per_group)
    tail = logits[:, groups * per_group:]
    tr, tc = np.divmod(np.flatnonzero(tail >= bounds[:, None]), tail.shape[1])
    return (np.concatenate([r[pair], tr]), np.concatenate([g[pair] + groups * member, tc + groups * per_group]),
            np.concatenate([members[pair, member], tail[tr, tc]]))


def _row_value_id_order(rows: np.ndarray, values: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    """The permutation sorting by row, then value descending, then id: one int64 argsort of a
    packed key (a third of np.lexsort's time), where row, value and id bits fit in 63."""
    id_bits = max(vocab - 1, 1).bit_length()
    if int(rows.max(initial=0)).bit_length() + 32 + id_bits > 63:
        return np.lexsort((ids, -values, rows))
    bits = (values.astype(np.float32) + np.float32(0)).view(np.uint32).astype(np.int64)  # + 0: -0.0 ties 0.0
    ascending = np.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits | 1 << 31)  # float order as unsigned ints
    key = (rows.astype(np.int64) << (32 + id_bits)) | ((0xFFFFFFFF - ascending) << id_bits) | ids
    return np.argsort(key)


def _draw_from_candidates(logits: np.ndarray, ids: np.ndarray, rows: Sequence[SamplingRow], vocab: int,
                          totals: np.ndarray) -> np.ndarray:
    """min_p -> top_k -> top_p over each row's top candidates (``ids``, largest first), then the
    inverse-CDF draw (``totals``: the softmax denominators of the wide nucleus rows, _softmax_totals); -1 (and no random number used) for a row whose candidates cannot hold the
    answer. Every step is a row-wise array operation, so a row's token never depends on its
    batch-mates."""
    n, k = ids.shape
    params = [r.params for r in rows]
    top_logits = np.take_along_axis(logits, ids, axis=1).astype(np.float64)
    temps = np.array([p.temperature for p in params])[:, None]
    weights = np.exp((top_logits - top_logits[:, :1]) / temps)  # p / p(max), descending
    complete = np.array([bool(p.top_k and p.top_k < vocab) or k >= vocab for p in params])
    last = np.full(n, k - 1)  # index of the last kept candidate
    ok = np.ones(n, dtype=bool)
    min_p = np.array([p.min_p for p in params])
    if min_p.any():
        above = np.count_nonzero(weights >= min_p[:, None], axis=1)
        cut = min_p > 0
        ok &= ~(cut & (above == k) & ~complete)  # more tokens may pass min_p beyond the candidates
        last = np.where(cut, above - 1, last)
        complete |= cut
    columns = np.arange(k)
    cum = np.cumsum(np.where(columns <= last[:, None], weights, 0.0), axis=1)
    top_p = np.array([p.top_p for p in params])
    nucleus = np.flatnonzero(top_p < 1.0)
    if len(nucleus):
        total = cum[nucleus, -1]
        wide = ~complete[nucleus]  # their softmax denominator spans the whole vocabulary
        total[wide] = totals[nucleus[wide]]
        mass = top_p[nucleus] * total
        ok[nucleus] &= cum[nucleus, -1] >= mass  # else a very flat distribution: the nucleus reaches beyond
        last[nucleus] = np.minimum(last[nucleus], np.count_nonzero(cum[nucleus] < mass[:, None], axis=1))
    u = np.zeros(n)
    u[ok] = [rows[i].uniform() for i in np.flatnonzero(ok).tolist()]
    kept_mass = cum[np.arange(n), last]
    # cum never falls past `last` (flat after a min_p cut, rising past a nucleus), so the count stops there
    picked = np.count_nonzero(cum < (u * kept_mass)[:, None], axis=1)
    return np.where(ok, ids[np.arange(n), picked], -1)


def _softmax_totals(logits: np.ndarray, rows: np.ndarray, maxima: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """For the given rows and their largest logits: sum(exp((logits - max) / T)) over the whole
    vocabulary (the softmax denominator relative to the top token's weight of 1). In blocks of rows
    that fit the cache (whole-batch temporaries of a large vocabulary took 2.7x as long), elementwise
    per row and summed along each row in float32 (pairwise: ~1e-7 relative, far below what a nucleus
    boundary resolves), so a row's total never depends on its batch-mates."""
    vocab = logits.shape[1]
    sums = np.empty(len(rows))
    block = max(1, TOTALS_BLOCK_VALUES // vocab)
    for s in range(0, len(rows), block):
        z = logits[rows[s:s + block]]  # a copy, worked on in place
        z -= maxima[s:s + block, None].astype(np.float32)
        z /= temperatures[s:s + block, None].astype(np.float32)
        sums[s:s + block] = np.exp(z, out=z).sum(axis=1)
    return sums


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
    u = np.array(uniforms(rows))[:, None]
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
    out = [SampledToken(t, None, NO_ALTERNATIVES, NO_ALTERNATIVES) for t in chosen.tolist()]
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
