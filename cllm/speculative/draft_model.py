"""Draft-model proposals: a smaller model with the target's vocabulary, on the same backend kind.

The draft model keeps its own KV per request (admitted under the request's id in its own backend),
kept in step with the target: each proposal first feeds it the tokens it has not seen (the whole
prompt the first time, then the tokens the last verification kept), then decodes greedily, one
batched forward per draft depth. After the verification the tokens the target rejected are cut from
its KV (``sync``). Greedy drafts make every proposal a single token, so the engine's
sample-and-compare acceptance is the exact rule (see LLMEngine._verify). A failing draft forward
costs only the proposal: the request goes on without drafts.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from cllm.backends.base import Backend, BackendError
from cllm.backends.llama_cpp.slot_pool import common_prefix_len
from cllm.request import Request

log = logging.getLogger("cllm.speculative")

SMOOTHING = 0.2  # weight of the newest draft decode step in the moving average of its time


class DraftModel:
    """Greedy proposals from a second backend (``speculative_model``)."""

    def __init__(self, backend: Backend, *, vocab_size: int) -> None:
        if backend.tokenizer.vocab_size != vocab_size:
            backend.close()
            raise ValueError(f"speculative_model has a vocabulary of {backend.tokenizer.vocab_size} tokens but the "
                             f"model has {vocab_size}: a draft model must share the target's tokenizer")
        self.backend = backend
        self._held: dict[str, list[int]] = {}  # request id -> tokens whose KV the draft model holds
        self._seconds = 0.0  # one batched draft decode step, moving average
        self._warned = False

    def step_seconds(self) -> float:
        return self._seconds

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k greedy draft tokens per (request, k); a request the draft model cannot place gets none."""
        live = [(req, k) for req, k in wanted if self._place(req, k)]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in live}
        try:
            feed = [(req.request_id, req.all_token_ids[len(self._held[req.request_id]):]) for req, _ in live]
            for depth in range(max((k for _, k in live), default=0)):
                started = time.perf_counter()
                picked = self._feed(feed)
                if depth:
                    self._seconds += SMOOTHING * (time.perf_counter() - started - self._seconds)
                for rid, token in picked.items():
                    drafts[rid].append(token)
                feed = [(req.request_id, [drafts[req.request_id][-1]]) for req, k in live if k > depth + 1]
        except BackendError as err:
            self._failed(err)
            return {rid: tokens for rid, tokens in drafts.items() if rid not in err.sequence_ids}
        return drafts

    def _place(self, req: Request, k: int) -> bool:
        """Admit the request in the draft backend (or keep it there) with room for its next k tokens."""
        rid = req.request_id
        held = self._held.get(rid)
        if held is None:
            admission = self.backend.admit(rid, req.all_token_ids)
            if admission is None:
                return False
            held = self._held[rid] = req.all_token_ids[:admission.num_cached_tokens]
        # Keep only what is still the sequence's own: draft tokens no verification synced (the scheduler
        # dropped the draft: no KV room for it) are cut, and the last token is evaluated again (its
        # logits are needed).
        tokens = req.all_token_ids
        same = len(held) if tokens[:len(held)] == held else common_prefix_len(held, tokens)  # (the usual case: a C compare)
        keep = min(same, req.num_tokens - 1)
        if keep < len(held):
            del held[self.backend.truncate(rid, keep):]
        return self.backend.reserve(rid, req.num_tokens + k)

    def _feed(self, feed: list[tuple[str, list[int]]]) -> dict[str, int]:
        """Evaluate each sequence's new tokens (split to the backend's batch size); its greedy next token."""
        cap = self.backend.capacity.max_batch_tokens
        picked: dict[str, int] = {}
        batch: list[tuple[str, list[int]]] = []
        size = 0
        for rid, tokens in feed:
            while len(tokens) > cap:  # a long catch-up runs alone, a batch-size piece at a time
                self._forward([(rid, tokens[:cap])], want=False)
                tokens = tokens[cap:]
            if size + len(tokens) > cap:
                picked.update(self._forward(batch))
                batch, size = [], 0
            batch.append((rid, tokens))
            size += len(tokens)
        if batch:
            picked.update(self._forward(batch))
        return picked

    def _forward(self, batch: list[tuple[str, list[int]]], want: bool = True) -> dict[str, int]:
        flat: list[int] = []
        positions: list[int] = []
        seqs: list[str] = []
        for rid, tokens in batch:
            start = len(self._held[rid])
            flat += tokens
            positions += range(start, start + len(tokens))
            seqs += [rid] * len(tokens)
        wanted = [rid for rid, _ in batch] if want else []
        logits = self.backend.forward_batch(flat, positions, seqs, logits_for=wanted)
        for rid, tokens in batch:
            self._held[rid] += tokens
        return {rid: int(logits[i].argmax()) for i, rid in enumerate(wanted)}

    def sync(self, req: Request) -> None:
        """After a verification: cut the draft tokens the target did not keep from the draft KV."""
        held = self._held.get(req.request_id)
        if held is None:
            return
        keep = common_prefix_len(held, req.all_token_ids)
        if keep < len(held):
            del held[self.backend.truncate(req.request_id, keep):]

    def release(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:
            self.backend.release(request_id)

    def _failed(self, err: BackendError) -> None:
        if not self._warned:
            log.warning("draft model forward failed (%s): those requests go on without drafts", err)
            self._warned = True
        for rid in err.sequence_ids:
            if self._held.pop(rid, None) is not None:
                self.backend.release(rid, keep_cache=False)

    def close(self) -> None:
        for rid in list(self._held):
            self.release(rid)
        self.backend.close()
