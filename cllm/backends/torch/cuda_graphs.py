"""CUDA graphs for pure decode steps: one captured graph per batch-size bucket, batches padded up.

A decode step of a small model is dominated by kernel launches (hundreds per
step); replaying a captured graph launches them all at once. Graphs need fixed
shapes and fixed tensor addresses, so:

- batch sizes are rounded up to a bucket (1, 2, 4, then multiples of 8, as
  vLLM) and the extra rows are *padding*: token 0 at position 0 whose block
  table is the backend's scratch block (one KV block no sequence ever owns).
  A padding row writes its K/V there and attends only to that slot, so it
  never touches a real sequence's KV, and every op is row-wise, so real rows'
  results do not depend on it (up to the GEMM kernel chosen for the larger
  batch: float rounding, tested with a tolerance);
- per bucket, every input (token ids, positions, KV write rows, the
  FlexAttention paged-mask tensors) lives in a static buffer; a step copies
  its values in and replays.

Only FlexAttention decode is captured (its block mask is made of fixed-shape
tensors; the SDPA path's gather is sized by the longest context). The
bucket/padding logic and the static-buffer step run on CPU too, without
capture (``capture=False``), which is how they are tested here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cllm.backends.torch.attention import AttentionBatch, SeqChunk, slot_mapping
from cllm.backends.torch.flex import FlexDecode, PagedMaskTensors, flex_decode_tensors, paged_block_mask
from cllm.backends.torch.kv_cache import PagedKVCache

PAD_TOKEN = 0  # any valid id: padding rows' outputs are dropped


def graph_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 up to ``max_batch`` (which is included)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket holding ``n`` rows; None when ``n`` exceeds the largest (run eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def pad_decode(ids: np.ndarray, chunks: Sequence[SeqChunk], bucket: int, scratch_block: int) -> tuple[np.ndarray, list[SeqChunk]]:
    """Token ids and per-row chunks of a pure decode step, padded with scratch-block rows to ``bucket``."""
    n = len(chunks)
    if bucket < n or len(ids) != n or any(c.num_tokens != 1 for c in chunks):
        raise ValueError(f"pad_decode takes a pure decode step of at most {bucket} rows (got {n} chunks, {len(ids)} tokens)")
    pads = [SeqChunk(row, 1, 0, (scratch_block,)) for row in range(n, bucket)]
    return np.concatenate([ids, np.full(bucket - n, PAD_TOKEN, dtype=np.int64)]), list(chunks) + pads


@dataclass(slots=True)
class _Bucket:
    """One batch size's static buffers (and graph, when captured)."""

    ids: torch.Tensor  # [b] token ids
    positions: torch.Tensor  # [b]
    write_rows: torch.Tensor  # [b * kv_heads] KV cache rows of the new tokens
    mask: PagedMaskTensors  # FlexAttention paged-mask tensors
    batch: AttentionBatch  # built once over the buffers above
    logit_rows: torch.Tensor  # arange(b)
    logits: torch.Tensor | None = None  # output buffer of the captured graph
    graph: torch.cuda.CUDAGraph | None = None  # None = run eagerly over the buffers (CPU, tests)


class DecodeGraphs:
    """Runs pure decode steps through per-bucket static buffers, replaying CUDA graphs when captured."""

    def __init__(self, forward: Callable[..., torch.Tensor], cache: PagedKVCache, *, buckets: Sequence[int],
                 scratch_block: int, flex_fn: Callable[..., torch.Tensor], capture: bool) -> None:
        self._forward, self._cache, self._scratch = forward, cache, scratch_block
        self._flex_fn, self._capture = flex_fn, capture
        self.buckets = list(buckets)
        self._by_size: dict[int, _Bucket] = {}
        self._pool: tuple[int, int] | None = None  # memory pool shared by all captured graphs

    def capture_all(self) -> None:
        """Build (and on CUDA capture) every bucket up front, largest first (graphs share a memory pool)."""
        for b in sorted(self.buckets, reverse=True):
            self._bucket(b)

    def run(self, ids: np.ndarray, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """Float32 logits ``[n, vocab]`` of a pure decode step; None if it is larger than every bucket."""
        size = bucket_for(len(chunks), self.buckets)
        if size is None:
            return None
        padded_ids, padded = pad_decode(ids, chunks, size, self._scratch)
        bucket = self._bucket(size)
        self._fill(bucket, padded_ids, padded)
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
        else:
            logits = self._step(bucket)
        return logits[: len(chunks)]  # type: ignore[index]

    def _fill(self, bucket: _Bucket, ids: np.ndarray, chunks: Sequence[SeqChunk]) -> None:
        cache = self._cache
        device = cache.k.device
        bucket.ids.copy_(torch.from_numpy(ids).to(device))
        bucket.positions.copy_(torch.tensor([c.start_pos for c in chunks], device=device))
        bucket.write_rows.copy_(torch.from_numpy(cache.write_rows(slot_mapping(chunks, cache.shape.block_size))).to(device))
        bucket.mask.copy_from(flex_decode_tensors([c.start_pos + 1 for c in chunks], [c.block_ids for c in chunks], cache))

    def _step(self, bucket: _Bucket) -> torch.Tensor:
        return self._forward(bucket.ids, bucket.positions, self._cache, bucket.batch, bucket.logit_rows)

    def _bucket(self, size: int) -> _Bucket:
        if size in self._by_size:
            return self._by_size[size]
        cache = self._cache
        device = cache.k.device
        idle = [SeqChunk(row, 1, 0, (self._scratch,)) for row in range(size)]  # all rows padding until filled
        mask = flex_decode_tensors([1] * size, [c.block_ids for c in idle], cache)
        rows = torch.from_numpy(cache.write_rows(slot_mapping(idle, cache.shape.block_size))).to(device)
        batch = AttentionBatch(rows, FlexDecode(None, size, paged_block_mask(mask, 1, cache)), [], None, self._flex_fn)
        bucket = _Bucket(torch.zeros(size, dtype=torch.int64, device=device), torch.zeros(size, dtype=torch.int64, device=device),
                         rows, mask, batch, torch.arange(size, device=device))
        if self._capture:
            self._capture_graph(bucket)
        self._by_size[size] = bucket
        return bucket

    def _capture_graph(self, bucket: _Bucket) -> None:
        # Warm up on a side stream (compiles kernels, allocates workspaces), then capture one step.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = self._step(bucket)
        self._pool = graph.pool()
        bucket.graph = graph
