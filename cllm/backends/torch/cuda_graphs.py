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
  its values in and replays;
- the buffers are a *persistent batch*: their host mirror keeps each row's
  block table from the last step, and a step rewrites a row's table only
  when the row now holds another sequence or its sequence reached a new
  block (a sequence keeps its row while the batch's order holds, which the
  scheduler's decode order does). A row's KV write rows (its slot mapping)
  advance by one slot while its sequence is one token further in the same
  block; only the other rows' slots are looked up in their tables. Ids and
  positions are per-row vectors written whole (the engine hands the
  positions over each step). At 256 decoding sequences that turns the
  tables' rebuild (one scatter over every block of every row, plus a per-row
  lookup on CPU) into a few rows' worth. One asynchronous copy per dtype then
  uploads the mirror; a step launched ahead (the lookahead) copies its ids
  device to device after it.

Only FlexAttention decode is captured (its block mask is made of fixed-shape
tensors; the SDPA path's gather is sized by the longest context). The
bucket/padding logic and the static-buffer step run on CPU too, without
capture (``capture=False``), which is how they are tested here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cllm.backends.torch.attention import AttentionBatch, SeqChunk, slot_mapping
from cllm.backends.torch.flex import FlexDecode, PagedMaskTensors, decode_mask_arrays, paged_block_mask
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


def _same_table(held: Sequence[int] | None, table: Sequence[int]) -> bool:
    """Whether a row's block table is the one the mirror holds: the same list (a sequence's tables only
    grow at the end, or are replaced when cut) or an equal tuple (padding rows)."""
    return held is table or (isinstance(table, tuple) and held == table)


def pad_decode(ids: np.ndarray, chunks: Sequence[SeqChunk], bucket: int, scratch_block: int) -> tuple[np.ndarray, list[SeqChunk]]:
    """Token ids and per-row chunks of a pure decode step, padded with scratch-block rows to ``bucket``."""
    n = len(chunks)
    if bucket < n or len(ids) != n or any(c.num_tokens != 1 for c in chunks):
        raise ValueError(f"pad_decode takes a pure decode step of at most {bucket} rows (got {n} chunks, {len(ids)} tokens)")
    pads = [SeqChunk(row, 1, 0, (scratch_block,)) for row in range(n, bucket)]
    return np.concatenate([ids, np.full(bucket - n, PAD_TOKEN, dtype=np.int64)]), list(chunks) + pads


class StagedInputs:
    """A step's static integer inputs as views of one device buffer per dtype, refilled each step from
    a pinned host buffer with one asynchronous copy per dtype (instead of one blocking copy per input)."""

    def __init__(self, first: dict[str, np.ndarray], device: torch.device) -> None:
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copies' completion
        for dtype in sorted({a.dtype for a in first.values()}, key=str):
            names = [n for n, a in first.items() if a.dtype == dtype]
            total = sum(first[n].size for n in names)
            host = torch.from_numpy(np.zeros(total, dtype=dtype))
            if device.type == "cuda":
                host = host.pin_memory()
            dev = torch.zeros(total, dtype=host.dtype, device=device)
            flat = host.numpy()
            start = 0
            for n in names:
                size, shape = first[n].size, first[n].shape
                self.host[n] = flat[start : start + size].reshape(shape)
                self.device[n] = dev[start : start + size].view(shape)
                start += size
            self._pairs.append((dev, host))
        self.fill(first)

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        host = self.writable()
        for name, array in arrays.items():
            host[name][...] = array
        self.upload()

    def writable(self) -> dict[str, np.ndarray]:
        """The host mirror, once the last upload has read it (normally long since)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def upload(self) -> None:
        """Copy the host mirror to the device buffers, asynchronously (one copy per dtype)."""
        for dev, host in self._pairs:
            dev.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


@dataclass(slots=True)
class _Bucket:
    """One batch size's static buffers (and graph, when captured)."""

    inputs: StagedInputs  # ids [b], positions [b], write_rows [b * kv_heads], the mask fields
    batch: AttentionBatch  # built once over the buffers above
    logit_rows: torch.Tensor  # arange(b)
    logits: torch.Tensor | None = None  # output buffer of the captured graph
    graph: torch.cuda.CUDAGraph | None = None  # None = run eagerly over the buffers (CPU, tests)
    # per row: the block table (the sequence's own list, or a padding tuple) and how many of its blocks
    # the mirror's mask arrays list (the persistent batch: see the module docstring)
    tables: list[tuple[Sequence[int] | None, int]] = field(default_factory=list)


class DecodeGraphs:
    """Runs pure decode steps through per-bucket static buffers, replaying CUDA graphs when captured."""

    def __init__(self, forward: Callable[..., torch.Tensor], cache: PagedKVCache, *, buckets: Sequence[int],
                 scratch_block: int, flex_fn: Callable[..., torch.Tensor], capture: bool, q_per_kv: int) -> None:
        self._forward, self._cache, self._scratch, self._q_per_kv = forward, cache, scratch_block, q_per_kv
        self._flex_fn, self._capture = flex_fn, capture
        self.buckets = list(buckets)
        self._by_size: dict[int, _Bucket] = {}
        self._pool: tuple[int, int] | None = None  # memory pool shared by all captured graphs
        self._logits: torch.Tensor | None = None  # [largest bucket, vocab] float32: every graph's output rows
        self._next_slot = cache.write_rows(np.ones(1, dtype=np.int64)) - cache.write_rows(np.zeros(1, dtype=np.int64))

    def capture_all(self, on_each: Callable[[], None] | None = None) -> None:
        """Build (and on CUDA capture) every bucket up front, largest first (graphs share a memory pool);
        ``on_each`` is called after each (progress)."""
        for b in sorted(self.buckets, reverse=True):
            self._bucket(b)
            if on_each is not None:
                on_each()

    def run(self, ids: np.ndarray | torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """Float32 logits ``[n, vocab]`` of a pure decode step; None if it is larger than every bucket.
        ``ids`` may be a device tensor (a step launched ahead on sampled ids): copied device to device
        into the ids buffer after the host's inputs (stream order keeps the copies in that order)."""
        size = bucket_for(len(chunks), self.buckets)
        if size is None:
            return None
        on_device = isinstance(ids, torch.Tensor)
        host_ids = np.zeros(len(chunks), dtype=np.int64) if on_device else ids
        padded_ids, padded = pad_decode(host_ids, chunks, size, self._scratch)
        bucket = self._bucket(size)
        self._fill(bucket, padded_ids, padded)
        if on_device:
            bucket.inputs.device["ids"][: len(chunks)].copy_(ids)
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
        else:
            logits = self._step(bucket)
        return logits[: len(chunks)]  # type: ignore[index]

    def _arrays(self, ids: np.ndarray, chunks: Sequence[SeqChunk]) -> dict[str, np.ndarray]:
        cache = self._cache
        return {"ids": ids.astype(np.int64), "positions": np.array([c.start_pos for c in chunks], dtype=np.int64),
                "write_rows": cache.write_rows(slot_mapping(chunks, cache.shape.block_size)).astype(np.int64),
                **decode_mask_arrays([c.start_pos + 1 for c in chunks], [c.block_ids for c in chunks], cache)}

    def _fill(self, bucket: _Bucket, ids: np.ndarray, chunks: Sequence[SeqChunk]) -> None:
        """Update the bucket's host mirror for this step (rows whose table changed are rewritten, see the
        module docstring) and upload it."""
        cache = self._cache
        bs = cache.shape.block_size
        host = bucket.inputs.writable()
        pos = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
        blocks = -(-(pos + 1) // bs)
        tables = bucket.tables
        if len(tables) != len(chunks):
            tables[:] = [(None, 0)] * len(chunks)
        changed = [i for i, (c, (table, held)) in enumerate(zip(chunks, tables))
                   if held != blocks[i] or not _same_table(table, c.block_ids)]
        # A row whose sequence is one token further in the same block writes the slot after the last one;
        # only the others' slots are looked up in their tables (a new block is a changed table).
        moved = host["positions"] != pos - 1
        moved[changed] = True
        write_rows = host["write_rows"].reshape(len(chunks), -1)  # (a view: one row of kv-head entries per row)
        write_rows += self._next_slot
        if moved.any():
            again = np.flatnonzero(moved)
            write_rows[again] = cache.write_rows(slot_mapping([chunks[i] for i in again], bs)).reshape(len(again), -1)
        host["ids"][...] = ids
        host["positions"][...] = pos
        host["base"][...] = pos
        if changed:
            rows = decode_mask_arrays((pos[changed] + 1).tolist(), [chunks[i].block_ids for i in changed], cache)
            for name, values in rows.items():
                if name != "base":
                    host[name][changed] = values
            for i in changed:
                tables[i] = (chunks[i].block_ids, int(blocks[i]))
        bucket.inputs.upload()

    def _step(self, bucket: _Bucket) -> torch.Tensor:
        t = bucket.inputs.device
        return self._forward(t["ids"], t["positions"], self._cache, bucket.batch, bucket.logit_rows)

    def _bucket(self, size: int) -> _Bucket:
        if size in self._by_size:
            return self._by_size[size]
        cache = self._cache
        device = cache.k.device
        idle = [SeqChunk(row, 1, 0, (self._scratch,)) for row in range(size)]  # all rows padding until filled
        inputs = StagedInputs(self._arrays(np.zeros(size, dtype=np.int64), idle), device)
        t = inputs.device
        mask = PagedMaskTensors(**{f: t[f] for f in PagedMaskTensors.__slots__ if f in t})
        decode = FlexDecode(None, size, paged_block_mask(mask, self._q_per_kv, cache, causal=False))
        batch = AttentionBatch(t["write_rows"], decode, [], None, self._flex_fn)
        bucket = _Bucket(inputs, batch, torch.arange(size, device=device))
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
                warm = self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        if self._logits is None:  # the largest bucket comes first: one output buffer serves every graph
            self._logits = torch.empty((max(self.buckets), warm.shape[1]), dtype=warm.dtype, device=warm.device)
        size = warm.shape[0]
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            # The step's own logits are freed at the end of the capture (the pool reuses them for the
            # next graph); only the shared buffer lives on. One [bucket, vocab] float32 output per graph
            # was ~2.2 GB over 35 buckets at a 128 k vocabulary, outside the KV sizing.
            self._logits[:size].copy_(self._step(bucket))
        self._pool = graph.pool()
        bucket.logits = self._logits[:size]
        bucket.graph = graph
        self.check(bucket, replay=lambda: (graph.replay(), self._logits[:size])[1])

    def check(self, bucket: _Bucket, replay: Callable[[], torch.Tensor]) -> None:
        """Run ``replay`` (the bucket's captured graph) on inputs other than those it was captured on and
        compare its logits with the eager step over the same buffers; RuntimeError if they differ. A capture
        that froze something computed from its inputs (a host-side value, a tensor made during capture: a
        risk on the generic path, whose forward is transformers' code) fails here, at load, where the
        backend falls back to eager steps, instead of answering wrongly.

        The probe rows: row ``i`` < block size takes id ``i`` at position ``i`` of the scratch block (each
        writes its own slot and reads the rows before it); later rows repeat row 0 (id 0 at position 0: the
        same K/V into the same slot), so the result does not depend on the order of the writes."""
        rows = np.arange(len(bucket.logit_rows))
        ids = np.where(rows < self._cache.shape.block_size, rows, 0).astype(np.int64)  # also the positions
        self._fill(bucket, ids, [SeqChunk(row, 1, int(ids[row]), (self._scratch,)) for row in rows])
        got = replay().float().clone()
        want = self._step(bucket).float()
        scale = float(want.abs().max())
        error = float((got - want).abs().max())
        if not error <= 1e-3 * max(scale, 1.0):  # also catches NaN
            raise RuntimeError(f"the captured graph of {len(rows)} rows gave logits {error:.3g} away from the eager step's "
                               f"(largest {scale:.3g}) on the same inputs")
