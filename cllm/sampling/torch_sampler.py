"""Batched sampler on the logits' own device (torch): the numpy sampler's semantics, without the copy.

Same processing order as :mod:`cllm.sampling.sampler`: logit_bias, penalties,
min_tokens suppression, logprobs (before temperature), then greedy argmax or
temperature -> min_p -> top_k -> top_p -> inverse-CDF draw (over the kept tokens
largest first when a row truncates, over the vocabulary in id order otherwise). The logits stay on
their device; only the chosen ids (and, for rows that ask, their logprobs and
top alternatives) come back to the host. What goes to the device per step is
small: the biased / penalised token ids and one uniform number per sampled row.

That uniform comes from the request's own ``np.random.Generator`` (one
``SamplingRow.uniform()`` per step, exactly as the numpy sampler draws it), so a seeded
request consumes the same random stream whichever sampler serves it and
whatever its batch-mates are. The two samplers then pick the same token unless
the uniform falls within float rounding of a CDF boundary (their cumulative
sums round differently).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cllm.sampling.sampler import GREEDY, NO_ALTERNATIVES, UNIFORMS_AHEAD, SampledToken, SamplingRow

# CPU: a truncating row is first cut from its top 64 probabilities, then 512, then all of them
# (_truncated_draw); a tier is used only where it is at most a quarter of the vocabulary.
CANDIDATE_TIERS = (64, 512)


@dataclass(slots=True)
class DeviceSample:
    """The chosen tokens of a batch, still on the logits' device; ``results()`` brings them to the host.

    Everything is launched when this is made (the host-side inputs, penalties and the request's uniform
    draw included); only ``results()`` waits for the device, so a caller can launch more work first
    (the engine's lookahead launches the next decode step on ``token_ids``)."""

    token_ids: torch.Tensor  # [B] int64 on the logits' device (next step's input without a round trip)
    rows: Sequence[SamplingRow]
    logprob_rows: list[int]  # rows that asked for logprobs
    logprobs: torch.Tensor | None  # their log-softmax rows
    _results: list[SampledToken] | None = None

    def results(self) -> list[SampledToken]:
        """Per row: the id, and logprobs when asked (host values). Waits for the device the first time."""
        if self._results is None:
            self._results = _results(self.token_ids, self.rows, self.logprob_rows, self.logprobs)
        return self._results


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ``[B, vocab]`` (modified in place), as the numpy sampler."""
    return sample_on_device(logits, rows).results()


def sample_on_device(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
    """:func:`sample`, launched: the chosen ids as a device tensor, their host copy on ``results()``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} sequences (want [{len(rows)}, vocab])")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits dtype {logits.dtype}: the sampler works in float32, as the numpy one")
    if all(r.plain for r in rows):  # the usual greedy batch: its argmax (a row loop costs less than numpy calls)
        return DeviceSample(argmax_rows(logits), rows, [], None)
    settings = table_for(logits.device, logits.shape[1]).settings(rows)
    logprob_rows: list[int] = []
    if settings.adjusted.any():  # (one look at a plain batch, not one per setting)
        _apply_biases_and_penalties(logits, rows)
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
    stochastic = np.flatnonzero(settings.draw != GREEDY)
    if len(stochastic) == len(rows):
        chosen = _draw(logits, rows, settings)  # (reads logits, as the greedy rows' argmax below would)
    else:
        chosen = argmax_rows(logits)
        if len(stochastic):
            index = _to(logits.device, stochastic)
            chosen[index] = _draw(logits.index_select(0, index), [rows[i] for i in stochastic],
                                  settings.take(stochastic))
    return DeviceSample(chosen, rows, logprob_rows, logprobs)


class SamplingTable:
    """The sampling settings of the rows one device samples, by slot: the persistent batch's sampling part.

    A row's temperature, top_p, min_p, top_k, draw kind and whether it is adjusted are written once, when it
    is first sampled here, into a slot it keeps while it lives (``SamplingRow.__del__`` frees it): in host
    arrays (for the host's decisions: which rows draw how) and in one device tensor (for the math), which
    takes the slots written since it was last used in one copy, when a batch first needs it (on a CPU too:
    one code path). A step gathers its rows' settings by one index, instead of reading a handful of
    attributes from every row and sending each list to the device. The slot also keeps the numbers drawn
    ahead from the row's generator, so that a batch's uniforms are taken at once (``uniforms``)."""

    def __init__(self, device: torch.device, vocab: int, capacity: int = 64) -> None:
        self.device, self.vocab = device, vocab
        self._lock = threading.Lock()  # (two engines may share a device)
        self._free: list[int] = []  # freed slots
        self._used = 0  # slots handed out so far (freed ones included)
        # per slot: what the host decides by (_DECIDE, float64: exact for every value), what the math takes
        # (_MATH, float32, mirrored to the device), and the numbers drawn ahead with how many are used
        self._decide = np.zeros((capacity, len(_DECIDE)))
        self._math = np.zeros((capacity, len(_MATH)), dtype=np.float32)
        self._ahead = np.zeros((capacity, UNIFORMS_AHEAD))
        self._cursor = np.zeros(capacity, dtype=np.int64)
        self._stale = np.zeros(capacity, dtype=np.bool_)  # written since the device copy was brought up to date
        self._device = self._device_copy()

    def settings(self, rows: Sequence[SamplingRow]) -> _Settings:
        """The settings of ``rows``, in their order (a row new here is given a slot)."""
        with self._lock:
            ids = [r.slot if r.table is self else self._place(r) for r in rows]
            slots = np.array(ids, dtype=np.int64)
            return _Settings(self, slots, self._decide[slots], distinct=len(set(ids)) == len(ids))

    def on_device(self, index: torch.Tensor) -> torch.Tensor:
        """The device columns (``_MATH``) of the slots at ``index`` (a device tensor)."""
        with self._lock:
            if self._stale.any():
                stale = np.flatnonzero(self._stale)
                self._stale[stale] = False
                self._device.index_copy_(0, _to(self.device, stale), _to(self.device, self._math[stale]))
            return self._device.index_select(0, index)

    def uniforms(self, rows: Sequence[SamplingRow], settings: _Settings) -> np.ndarray:
        """Each row's next random number (``settings``: theirs), the batch's at once: exactly the numbers
        ``row.uniform()`` would give, one by one (per-row Python was a quarter of a 256-row top-p call)."""
        with self._lock:
            slots, cursor, ahead = settings.slots, self._cursor, self._ahead
            if not settings.distinct:  # (a row twice: one after the other)
                return np.array([self._uniform(r) for r in rows])
            used = cursor[slots]
            for i in np.flatnonzero(used == UNIFORMS_AHEAD):  # (a row's UNIFORMS_AHEAD-th step)
                self._draw_ahead(rows[i])
                used[i] = 0
            cursor[slots] = used + 1
            return ahead[slots, used]

    def uniform(self, row: SamplingRow) -> float:
        """``row.uniform()`` of a row held here."""
        with self._lock:
            return self._uniform(row)

    def drop_ahead(self, slot: int) -> int:
        """Forget the numbers drawn ahead for ``slot``; how many were not used yet (``SamplingRow.rng``)."""
        with self._lock:
            unused = UNIFORMS_AHEAD - int(self._cursor[slot])
            self._cursor[slot] = UNIFORMS_AHEAD
            return unused

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def give_up(self, slot: int) -> list[float]:
        """Free ``slot`` of a row moving to another table; the numbers it drew ahead and has not used. (Only
        the row's own engine's thread touches its slot, and the caller holds the other table's lock: no lock.)"""
        unused = self._ahead[slot, self._cursor[slot]:].tolist()
        self.free(slot)
        return unused

    def _uniform(self, row: SamplingRow) -> float:
        cursor = self._cursor
        if cursor[row.slot] == UNIFORMS_AHEAD:
            self._draw_ahead(row)
        used = int(cursor[row.slot])
        cursor[row.slot] = used + 1
        return float(self._ahead[row.slot, used])

    def _draw_ahead(self, row: SamplingRow) -> None:
        self._ahead[row.slot] = row.draw_ahead()
        self._cursor[row.slot] = 0

    def _place(self, row: SamplingRow) -> int:
        """Give ``row`` a slot and write its settings there; the numbers it drew ahead come along."""
        if row.table is not None:  # (sampled on another device or vocabulary before)
            unused = row.table.give_up(row.slot)
        else:
            unused = row.take_ahead()
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._used = self._used, self._used + 1
            if slot == len(self._stale):
                self._grow()
        p, vocab = row.params, self.vocab
        top_k, draw = p.top_k if p.top_k and p.top_k < vocab else vocab, row.draw_for(vocab)
        self._decide[slot] = (draw, row.adjusted, top_k, np.float32(p.top_p), np.float32(p.min_p))
        self._math[slot] = (p.temperature, p.top_p, p.min_p, top_k)
        # the unused numbers last in the slot's row, so that the count used since the row's last draw
        # ahead is still the cursor (SamplingRow.rng rewinds by it)
        self._cursor[slot] = UNIFORMS_AHEAD - len(unused)
        if unused:
            self._ahead[slot, UNIFORMS_AHEAD - len(unused):] = unused
        self._stale[slot] = True
        row.table, row.slot = self, slot
        return slot

    def _grow(self) -> None:
        self._decide, self._math, self._ahead, self._cursor = (np.concatenate([a, np.zeros_like(a)]) for a in
                                                               (self._decide, self._math, self._ahead, self._cursor))
        self._stale = np.zeros(len(self._stale) * 2, dtype=np.bool_)
        self._device = self._device_copy()  # (made from the host's: nothing is stale)

    def _device_copy(self) -> torch.Tensor:
        return _to(self.device, self._math)


# (the order of _Settings' properties; top_k: the vocabulary where a row has none)
_DECIDE = ("draw", "adjusted", "top_k", "top_p", "min_p")
_MATH = ("temperature", "top_p", "min_p", "top_k")  # (float32: top_k is exact below 2**24)
_TABLES: dict[tuple[str, int | None, int], SamplingTable] = {}


def table_for(device: torch.device, vocab: int) -> SamplingTable:
    """The SamplingTable of ``device`` for a vocabulary of ``vocab`` tokens (made on first use)."""
    key = (device.type, device.index, vocab)  # (hashing a torch.device took longer)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES.setdefault(key, SamplingTable(device, vocab))
    return table


class _Settings:
    """Some rows' sampling settings, in the rows' order: the host's columns (``draw``, ``adjusted``, ``top_k``,
    ``top_p``, ``min_p``) for its decisions, and the device's for the math (``device(name)``, gathered when
    first asked)."""

    __slots__ = ("table", "slots", "distinct", "_decide", "_on_device")

    def __init__(self, table: SamplingTable, slots: np.ndarray, decide: np.ndarray, distinct: bool) -> None:
        """``decide``: the rows' _DECIDE columns (the table's, gathered at ``slots``); ``distinct``: no row twice."""
        self.table, self.slots, self.distinct, self._decide = table, slots, distinct, decide
        self._on_device: torch.Tensor | None = None

    @property
    def draw(self) -> np.ndarray:
        return self._decide[:, 0]

    @property
    def adjusted(self) -> np.ndarray:
        return self._decide[:, 1]

    @property
    def top_k(self) -> np.ndarray:
        return self._decide[:, 2]

    @property
    def top_p(self) -> np.ndarray:
        return self._decide[:, 3]

    @property
    def min_p(self) -> np.ndarray:
        return self._decide[:, 4]

    def device(self, name: str) -> torch.Tensor:
        """The rows' ``name`` (one of ``_MATH``) on the device (a view: not to be changed in place)."""
        if self._on_device is None:
            self._on_device = self.table.on_device(_to(self.table.device, self.slots))
        return self._on_device[:, _MATH.index(name)]

    def take(self, index: np.ndarray) -> _Settings:
        """The rows at ``index`` (ascending and distinct)."""
        if len(index) == len(self.slots):
            return self
        return _Settings(self.table, self.slots[index], self._decide[index], self.distinct)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (``x.argmax(dim=1)``, int64, on ``x``'s device).

    On a CPU through numpy: torch's CPU argmax took 247 µs for 256 x 1,024 floats on one thread of
    the AVX-512 EPYC, numpy's 23 µs (the same indices: both take the first of equal values)."""
    if x.device.type != "cpu":
        return x.argmax(dim=1)
    return torch.from_numpy(np.argmax(x.detach().numpy(), axis=1).astype(np.int64, copy=False))


def _flat_index(per_row: Sequence[np.ndarray], vocab: int) -> np.ndarray:
    """Row-major flat indices (row * vocab + id) of each row's ids."""
    parts = [ids.astype(np.int64) + i * vocab for i, ids in enumerate(per_row) if len(ids)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _apply_biases_and_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Every row's bias, penalties and min_tokens mask as a few batched scatters (no per-row kernels)."""
    vocab, device, flat = logits.shape[1], logits.device, logits.view(-1)
    # Each part is looked for first: building a per-row array for every row of a plain batch was ~1 µs
    # a row and step.
    if any(r.params.logit_bias for r in rows):
        bias_ids = [np.fromiter(r.params.logit_bias.keys(), dtype=np.int64) if r.params.logit_bias
                    else np.empty(0, np.int64) for r in rows]
        values = np.concatenate([np.fromiter(r.params.logit_bias.values(), dtype=np.float32) for r in rows if r.params.logit_bias])
        flat.index_add_(0, _to(device, _flat_index(bias_ids, vocab)), _to(device, values))
    if any(r.params.has_penalties for r in rows):
        _apply_penalties(logits, rows)
    if any(r.stop_ids and len(r.output_token_ids) < r.params.min_tokens for r in rows):
        blocked = [np.fromiter(r.stop_ids, dtype=np.int64) if len(r.output_token_ids) < r.params.min_tokens and r.stop_ids
                   else np.empty(0, np.int64) for r in rows]
        _suppress_stop(logits, _to(device, _flat_index(blocked, vocab)))


def _suppress_stop(logits: torch.Tensor, index: torch.Tensor) -> None:
    """min_tokens: stop ids to -inf, except in a row a grammar left nothing else in (it must end)."""
    flat = logits.view(-1)
    saved = flat[index]
    flat[index] = float("-inf")
    dead = ~torch.isfinite(logits).any(dim=1)
    restore = dead[index // logits.shape[1]]
    flat[index] = torch.where(restore, saved, flat[index])


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab, device, flat = logits.shape[1], logits.device, logits.view(-1)
    seen = [np.unique(np.asarray(list(r.prompt_token_ids) + list(r.output_token_ids), dtype=np.int64))
            if r.params.repetition_penalty != 1.0 else np.empty(0, np.int64) for r in rows]
    if any(len(s) for s in seen):
        index = _to(device, _flat_index(seen, vocab))
        factor = _to(device, np.repeat([r.params.repetition_penalty for r in rows], [len(s) for s in seen]).astype(np.float32))
        vals = flat[index]
        flat[index] = torch.where(vals > 0, vals / factor, vals * factor)
    counted = [np.unique(np.asarray(r.output_token_ids, dtype=np.int64), return_counts=True)
               if r.output_token_ids and (r.params.presence_penalty or r.params.frequency_penalty)
               else (np.empty(0, np.int64), np.empty(0, np.int64)) for r in rows]
    if any(len(ids) for ids, _ in counted):
        index = _to(device, _flat_index([ids for ids, _ in counted], vocab))
        # the numpy sampler's `frequency * count + presence`, in float64 there, cast once: same here
        amount = np.concatenate([r.params.frequency_penalty * counts + r.params.presence_penalty
                                 for r, (_, counts) in zip(rows, counted) if len(counts)]).astype(np.float32)
        flat.index_add_(0, index, -_to(device, amount))


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow], settings: _Settings) -> torch.Tensor:
    """Temperature, min_p / top_k / top_p truncation, then one inverse-CDF draw per row (none of them greedy).

    As the numpy sampler: a row that truncates (min_p, top_p, or a top_k below the vocabulary: a draw
    other than 0) walks its kept tokens largest first (ties by lower id); a row that does not walks the
    whole vocabulary in id order.
    """
    device, vocab = logits.device, logits.shape[1]
    probs = _weights(logits, settings.device("temperature"))
    u = _to(device, settings.table.uniforms(rows, settings)).to(torch.float32)[:, None]
    truncating = settings.draw != 0
    chosen = torch.empty(len(rows), dtype=torch.int64, device=device)
    if not truncating.all():
        whole = np.flatnonzero(~truncating)
        index = _to(device, whole)
        p, w = _rows(probs, index), _rows(u, index)
        chosen[index] = (p.cumsum(dim=1) < w * p.sum(dim=1, keepdim=True)).sum(dim=1).clamp_(max=vocab - 1)
    if truncating.any():
        cut = np.flatnonzero(truncating)
        index = _to(device, cut)
        chosen[index] = _truncated_draw(_rows(probs, index), settings.take(cut), _rows(u, index))
    return chosen


def _weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Each row's softmax at its temperature up to a factor: ``exp(logits / T - max)`` (the top token's
    weight is 1). Not normalised: every use compares a share of a row's total (min_p's of its top value),
    so dividing by the row's sum would change only rounding, for another pass over every value (60 µs a
    256-row step on a CPU). (In blocks of rows that stay in a core's cache, on a CPU, it took longer.)"""
    scaled = logits / temperatures[:, None]
    scaled -= scaled.amax(dim=1, keepdim=True)  # (max(dim) also finds the indices: 15x amax's time on a CPU)
    return _exp_(scaled)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """``x.exp_()``; on a CPU numpy's (256 x 1,024 floats on one thread of the AVX-512 EPYC: torch's
    229 µs, numpy's 125 µs; the numpy sampler's own exp)."""
    if x.device.type != "cpu":
        return x.exp_()
    np.exp(x.numpy(), out=x.numpy())
    return x


def _truncated_draw(probs: torch.Tensor, settings: _Settings, u: torch.Tensor) -> torch.Tensor:
    """The draw of rows that truncate (min_p, then top_k, then top_p), over their kept tokens largest first.

    On a GPU one stable sort of every row, with no host sync (the draw stays launched, DeviceSample). On
    a CPU that sort costs more than everything else a step samples (16 x 49,152 probabilities: 33 ms on
    a 2-core EPYC, against ~1 ms for their top 64), so there each row is first cut from its top
    CANDIDATE_TIERS candidates (or, where the top token alone reaches top_p, from it): exact wherever the
    kept tokens lie inside them (the answer and the
    order are the sorted path's, as the cumulative sums of a prefix are the prefix of the sums), and
    a row where they may not (a nucleus wider than its candidates, a tie across the last one) tries
    the next tier, the last one the whole sort. A row's draw never depends on its batch-mates.
    """
    device, vocab = probs.device, probs.shape[1]
    if (settings.min_p > 0).any():
        probs = probs.masked_fill(probs < settings.device("min_p")[:, None] * probs.amax(dim=1, keepdim=True), 0.0)
    top_k = settings.top_k
    chosen = torch.empty(len(top_k), dtype=torch.int64, device=device)
    todo = np.arange(len(top_k))
    tiers = [k for k in CANDIDATE_TIERS if device.type == "cpu" and k * 4 <= vocab and k > top_k[top_k < vocab].max(initial=0)]
    if tiers:
        # A nucleus of one: the top token alone holds top_p of the mass (after top_k at least as much of a
        # smaller total). The sorted path keeps just it, and its first id (argmax's) among equal values.
        alone = (probs.amax(dim=1) >= settings.device("top_p") * probs.sum(dim=1)).numpy() & (settings.top_p < 1.0)
        if alone.any():
            index = _to(device, np.flatnonzero(alone))
            chosen[index] = argmax_rows(_rows(probs, index))
            todo = todo[~alone]
    for k in tiers:
        if not len(todo):
            return chosen
        index = _to(device, todo)
        picks, exact = _candidate_draw(_rows(probs, index), settings.take(todo), _rows(u, index), k)
        chosen[index] = picks
        todo = todo[~exact.numpy()]
    if not len(todo):
        return chosen
    index = _to(device, todo)
    rows = _rows(probs, index)
    sorted_probs, order = rows.sort(dim=1, descending=True, stable=True)  # ties: lower id first
    kept = _cut(sorted_probs, rows, settings.take(todo))
    chosen[index] = _pick(kept, order, _rows(u, index))
    return chosen


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x``'s rows at ``index``, ascending distinct row numbers (so, where there are as many as rows, ``x``
    itself: no copy, and no look at the device's values)."""
    return x if len(index) == len(x) else x.index_select(0, index)


def _candidate_draw(probs: torch.Tensor, settings: _Settings, u: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's draw from its top ``k`` probabilities (CPU), and whether that draw is exact (else redo it)."""
    values, ids = probs.topk(k, dim=1)  # largest first; the order of equal values is topk's own
    ids, by_id = ids.sort(dim=1)  # the sorted path's order: ties by lower id first
    values, by_value = values.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    kept = _cut(values, probs, settings)
    # Exact where the last token kept lies above the last candidate: then every token left out is below
    # all kept ones, wherever topk cut a tie. Where the cut reaches the last candidate's value, the
    # kept tokens may go on beyond the candidates, or be other ids of a tie: the next tier decides.
    kept_count = (kept > 0).sum(dim=1, keepdim=True)
    last_kept = values.gather(1, (kept_count - 1).clamp_(min=0))[:, 0]
    return _pick(kept, ids, u), last_kept > values[:, -1]


def _cut(sorted_probs: torch.Tensor, probs: torch.Tensor, settings: _Settings) -> torch.Tensor:
    """top_k, then top_p (nucleus), on each row's largest probabilities ``sorted_probs`` (all of a row, or
    a prefix holding its kept tokens) of the min_p-cut ``probs``: the kept ones, zeros after. Each filter
    drops a suffix of that order (everything below a threshold), so the order of what remains never
    changes. The nucleus's mass is the row's total after top_k, summed in id order (the numpy sampler's)."""
    device, vocab = probs.device, probs.shape[1]
    top_k, top_p = settings.top_k, settings.top_p
    # (a row without top_k: its smallest value here, which cuts nothing)
    kth = sorted_probs.gather(1, settings.device("top_k").long().clamp_(max=sorted_probs.shape[1])[:, None] - 1)
    sorted_probs = sorted_probs.masked_fill(sorted_probs < kth, 0.0)
    if (top_p < 1.0).any():
        total = torch.where(settings.device("top_k")[:, None] < vocab, probs.masked_fill(probs < kth, 0.0), probs) \
            if (top_k < vocab).any() else probs
        mass = settings.device("top_p")[:, None] * total.sum(dim=1, keepdim=True)
        # smallest prefix reaching the mass: the numpy sampler's searchsorted(cum, mass) + 1
        keep = (sorted_probs.cumsum(dim=1) < mass).sum(dim=1, keepdim=True) + 1
        keep = torch.where(settings.device("top_p")[:, None] < 1.0, keep, vocab)
        ranks = torch.arange(sorted_probs.shape[1], device=device)[None, :]
        sorted_probs = sorted_probs.masked_fill(ranks >= keep, 0.0)
    return sorted_probs


def _pick(kept: torch.Tensor, order: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw over each row's kept probabilities (largest first), as token ids."""
    cum = kept.cumsum(dim=1)
    rank = (cum < u * cum[:, -1:]).sum(dim=1)
    rank = torch.minimum(rank, (kept > 0).sum(dim=1) - 1).clamp_(min=0)
    return order.gather(1, rank[:, None])[:, 0]


def _results(chosen: torch.Tensor, rows: Sequence[SamplingRow], logprob_rows: list[int],
             logprobs: torch.Tensor | None) -> list[SampledToken]:
    """Host results: one copy of the chosen ids, and of the asked-for logprobs only."""
    ids = chosen.tolist()
    out = [SampledToken(t, None, NO_ALTERNATIVES, NO_ALTERNATIVES) for t in ids]
    if logprobs is None:
        return out
    picked = torch.tensor([ids[i] for i in logprob_rows], device=logprobs.device)
    chosen_lp = logprobs.gather(1, picked[:, None])[:, 0].tolist()
    k_max = max(rows[i].params.logprobs or 0 for i in logprob_rows)
    top_lp, top_ids = (logprobs.topk(k_max, dim=1, sorted=True) if k_max else (None, None))
    top_lp = top_lp.tolist() if top_lp is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    for j, i in enumerate(logprob_rows):
        res = out[i]
        res.logprob = float(chosen_lp[j])
        k = rows[i].params.logprobs or 0
        if k:
            # A grammar's masked tokens (-inf) are no alternatives, as in the numpy sampler.
            top = [(int(t), float(v)) for t, v in zip(top_ids[j][:k], top_lp[j][:k]) if math.isfinite(v)]  # type: ignore[index]
            res.top_ids = [t for t, _ in top]
            res.top_logprobs = [v for _, v in top]
    return out


def _to(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """A host array on the device (non-blocking from pinned memory is not worth it for these few bytes)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
