"""StructuredOutputs: one grammar matcher per constrained sequence, and the step's logit mask."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cllm.backends.base import Tokenizer
from cllm.request import Request
from cllm.sampling.params import SamplingParams
from cllm.structured.cache import GrammarCache
from cllm.structured.limits import DEFAULT_LIMITS, ConstraintLimits


@dataclass(slots=True)
class _Tracked:
    """A sequence's matcher and how many of its output tokens the matcher has consumed."""

    matcher: Any  # xgrammar.GrammarMatcher
    accepted: int  # output tokens fed to the matcher; re-synced when it differs from the request's


@dataclass(slots=True)
class PendingMask:
    """Bitmask rows being filled for one step (a future), with the request each row belongs to."""

    request_ids: list[str]  # row i of the bitmask is for request_ids[i]
    future: concurrent.futures.Future  # resolves to the filled int32 bitmask (numpy, one row per request)


class StructuredOutputs:
    """Everything the engine does for constrained decoding, in four calls per step:
    ``start_fill`` before the forward pass, ``apply`` to the logits, ``accept`` after sampling,
    ``remove`` when a sequence ends."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
        self.cache = GrammarCache(tokenizer, cache_size, limits)
        self._vocab_size = tokenizer.vocab_size
        self._tracked: dict[str, _Tracked] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the mask-filling thread
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, with the pool
        self._inflight: concurrent.futures.Future | None = None  # a fill not consumed yet (the step failed)
        self._broken: dict[str, str] = {}  # request id -> why its matcher refused a token (the engine fails it)

    def compile(self, params: SamplingParams) -> Any | None:
        """Compile (or fetch) the request's grammar; ValueError if it does not compile."""
        return self.cache.get(params)

    def add(self, request: Request) -> None:
        """Start a matcher for a constrained sequence (a cache hit after ``compile``)."""
        compiled = self.cache.get(request.params)
        if compiled is None:
            return
        import xgrammar as xgr

        self._tracked[request.request_id] = _Tracked(xgr.GrammarMatcher(compiled), 0)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._tracked

    @property
    def active(self) -> bool:
        """Whether any running sequence is constrained (else a step skips the per-row checks)."""
        return bool(self._tracked)

    def start_fill(self, requests: Sequence[Request]) -> PendingMask | None:
        """Begin filling the bitmask of every constrained row about to be sampled: all rows in one
        batched xgrammar call, in a worker thread so it overlaps the forward pass."""
        if not self._tracked:  # nothing constrained (most steps): no per-row look-up
            return None
        self._settle()
        rows = [r for r in requests if r.request_id in self._tracked and self._sync(r)]
        if not rows:
            return None
        if self._pool is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cllm-grammar")
        matchers = [self._tracked[r.request_id].matcher for r in rows]
        self._inflight = self._pool.submit(self._fill, matchers)
        return PendingMask([r.request_id for r in rows], self._inflight)

    def _fill(self, matchers: list[Any]) -> np.ndarray:
        bitmask = np.empty((len(matchers), (self._vocab_size + 31) // 32), dtype=np.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def apply(self, logits: Any, request_ids: Sequence[str], pending: PendingMask | None) -> None:
        """Disallowed tokens of the constrained rows get -inf logits (in place): a numpy array, or a
        torch tensor on any device (xgrammar's kernel, no copy of the logits to the host)."""
        if pending is None:
            return
        bitmask = pending.future.result()
        self._inflight = None
        row_of = {rid: i for i, rid in enumerate(request_ids)}
        # A sequence the batch dropped (it failed alone) has no logits row.
        pairs = [(row_of[rid], k) for k, rid in enumerate(pending.request_ids) if rid in row_of]
        if not pairs:
            return
        rows, ks = (list(x) for x in zip(*pairs))
        if isinstance(logits, np.ndarray):
            logits[rows] = masked(logits[rows], bitmask[ks], self._vocab_size)
        else:
            _mask_tensor(logits, rows, bitmask[ks], self._vocab_size)

    def accept(self, request: Request) -> bool:
        """Advance the matcher by the sequence's newest token; True when the grammar is complete
        (the request stops there)."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return False
        self._settle()
        return self._sync(request) and bool(tracked.matcher.is_terminated())

    def take_broken(self) -> dict[str, str]:
        """Requests whose matcher refused one of their tokens since the last call (never expected:
        the mask allows only what the matcher accepts); the engine fails them, alone."""
        broken, self._broken = self._broken, {}
        return broken

    def _sync(self, request: Request) -> bool:
        """Feed the matcher the output tokens it has not seen (all of them after a hand-off: the new
        engine's matcher replays them). If the sequence's tokens went back (never today: preemption
        keeps output tokens), replay from the start. False if the matcher refused a token."""
        tracked = self._tracked[request.request_id]
        output = request.output_token_ids
        if tracked.accepted > len(output):
            tracked.matcher.reset()
            tracked.accepted = 0
        for token in output[tracked.accepted:]:
            if tracked.matcher.is_terminated():
                break
            if not tracked.matcher.accept_token(token):
                self._tracked.pop(request.request_id)
                self._broken[request.request_id] = f"constrained decoding failed: the grammar refused token {token}"
                return False
        tracked.accepted = len(output)
        return True

    def _settle(self) -> None:
        """Wait for a fill whose step ended early (a backend error): matchers are not thread-safe,
        and the worker may still be reading them."""
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
            self._inflight = None

    def remove(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def close(self) -> None:
        self._settle()
        self._tracked.clear()
        self.cache.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _mask_tensor(logits: Any, rows: list[int], bitmask: np.ndarray, vocab_size: int) -> None:
    import torch
    import xgrammar as xgr

    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)  # -1: every token allowed
    full[rows] = torch.from_numpy(bitmask)
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=vocab_size, indices=rows)
    if logits.shape[1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")


def masked(logits: np.ndarray, bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """``logits`` rows with -inf where the bitmask (int32 words; bit j of word w = token 32w + j)
    is 0, and on any logits padding past the vocabulary."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)
    out = logits.copy()
    width = min(out.shape[1], vocab_size)
    out[:, :width][~allowed[:, :width]] = -np.inf
    out[:, vocab_size:] = -np.inf
    return out
