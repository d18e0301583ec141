"""FlexAttention over the paged KV pool: each query reads only its sequence's live blocks, in place.

A layer's head-major pool is one ``[1, kv_heads, num_blocks * block_size, dim]``
tensor (:meth:`PagedKVCache.slot_views`); a :class:`BlockMask` lists, per
sequence (batch row) and query block, which physical KV blocks it reads: the
blocks wholly before the query as *full* blocks (no mask evaluated), the
block(s) holding the query positions as *partial* ones, where ``mask_mod``
hides the slots past each query. Nothing is gathered or padded to the longest
context; the kernel walks each sequence's own block list.

- Decode group: ``q`` is ``[B, heads, 1, dim]``; the KV pool is shared by the
  batch (batch dim 1, broadcast). Only the last block of each sequence is
  partial.
- Chunk after a cached prefix: ``q`` is ``[1, heads, n, dim]``, causal inside.
- ``mask_mod`` maps a slot back to its position through a physical -> logical
  block lookup per sequence, so it is exact by itself (the eager path, used in
  CPU tests, evaluates it everywhere and ignores the block lists).

FlexAttention's eager fallback computes the dense score matrix over the whole
pool (seconds per call on a large pool), so it must run compiled for speed;
on CPU this path is selectable but not the default (notes/torch.md, numbers).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from cllm.backends.torch.kv_cache import PagedKVCache

Q_BLOCK = 128  # query block of a chunk's mask (FlexAttention's default tile)

_compiled: list[Callable[..., torch.Tensor]] = []  # torch.compile(flex_attention), made once per process


@dataclass(slots=True)
class FlexDecode:
    """All one-token sequences of a step, one FlexAttention call."""

    rows: torch.Tensor | None  # flat rows of their tokens; None = the whole step is this group (rows 0..B-1)
    num_seqs: int  # B
    block_mask: BlockMask  # per sequence: full blocks + its last (partial) block


@dataclass(slots=True)
class FlexChunk:
    """One multi-token chunk after a cached prefix, one FlexAttention call."""

    row_start: int  # first flat row
    row_end: int  # one past its last flat row
    block_mask: BlockMask  # per query block: its visible blocks, causal inside


def flex_function(compiled: bool) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled once per process when asked (the fast path); eager otherwise (tests)."""
    if not compiled:
        return flex_attention
    if not _compiled:
        _compiled.append(torch.compile(flex_attention))
    return _compiled[0]


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _kv_index(compact: np.ndarray, cache: PagedKVCache) -> torch.Tensor:
    """Block-index table ``[B, 1, q_blocks, width]`` padded on the device to the pool's block count
    (compiled kernels require the table to span the whole KV length; only the listed count is read)."""
    t = _tensor(compact.astype(np.int32), cache.k.device)
    return torch.nn.functional.pad(t, (0, cache.shape.num_blocks - compact.shape[-1]))


@dataclass(slots=True)
class PagedMaskTensors:
    """The device tensors a paged block mask is made of. For a decode group their shapes depend only
    on the batch size and the pool, so a CUDA graph captures them once and each step copies new
    values in (:meth:`copy_from`)."""

    part_num: torch.Tensor  # [B, 1, q_blocks] int32: partially visible blocks per query block
    part_idx: torch.Tensor  # [B, 1, q_blocks, num_blocks] int32: their physical ids (first part_num valid)
    full_num: torch.Tensor  # [B, 1, q_blocks] int32: wholly visible blocks per query block
    full_idx: torch.Tensor  # [B, 1, q_blocks, num_blocks] int32: their physical ids
    block_of: torch.Tensor  # [B, num_blocks] int32: logical index of each physical block in the row's table, -1 = not its
    base: torch.Tensor  # [B] int64: position of the row's first query

    def copy_from(self, other: PagedMaskTensors) -> None:
        for name in self.__slots__:
            getattr(self, name).copy_(getattr(other, name))


def paged_mask_tensors(tables: np.ndarray, counts: np.ndarray, first_pos: np.ndarray, part_num: np.ndarray,
                       part_idx: np.ndarray, full_num: np.ndarray, full_idx: np.ndarray,
                       cache: PagedKVCache) -> PagedMaskTensors:
    """Upload compact host tables; widen and build the physical -> logical lookup on the device."""
    device, num_blocks = cache.k.device, cache.shape.num_blocks
    width = tables.shape[1]
    # padding columns of the tables scatter into a spare column past the pool, dropped after
    padded = np.where(np.arange(width)[None, :] < counts[:, None], tables, num_blocks)
    logical = torch.full((len(tables), num_blocks + 1), -1, dtype=torch.int32, device=device)
    logical.scatter_(1, _tensor(padded.astype(np.int64), device),
                     torch.arange(width, dtype=torch.int32, device=device).expand(len(tables), -1).contiguous())
    return PagedMaskTensors(
        _tensor(part_num.astype(np.int32), device), _kv_index(part_idx, cache),
        _tensor(full_num.astype(np.int32), device), _kv_index(full_idx, cache),
        logical[:, :num_blocks].contiguous(), _tensor(first_pos.astype(np.int64), device),
    )


def paged_block_mask(t: PagedMaskTensors, q_len: int, cache: PagedKVCache) -> BlockMask:
    """The BlockMask over ``t``: its mask_mod reads ``t``'s lookup tensors, so it is exact by itself
    (FlexAttention's eager path evaluates it on every slot of the pool; compiled kernels only on the
    partial blocks): a slot is visible to query q of row b when its block is one of b's and its
    position is at or before ``base[b] + q``."""
    bs = cache.shape.block_size
    block_of, base = t.block_of, t.base

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = block_of[b, kv // bs]
        return (lg >= 0) & (lg * bs + kv % bs <= base[b] + q)

    return BlockMask.from_kv_blocks(
        t.part_num, t.part_idx, t.full_num, t.full_idx, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
        seq_lengths=(q_len, cache.shape.num_blocks * bs),
        compute_q_blocks=False,  # inference only: the transposed (backward) tables would be [.., num_blocks] wide
    )


def flex_decode_tensors(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                        cache: PagedKVCache) -> PagedMaskTensors:
    """Decode group: sequence b reads its first ``ceil(len_b / block_size)`` blocks, all full but the
    last (which holds the new token)."""
    bs = cache.shape.block_size
    lens = np.asarray(context_lens, dtype=np.int64)
    nb = -(-lens // bs)
    tables = np.zeros((len(lens), int(nb.max())), dtype=np.int32)
    for b, (n, table) in enumerate(zip(nb, block_tables)):
        tables[b, :n] = table[:n]
    full_idx = np.where(np.arange(tables.shape[1])[None, :] < (nb - 1)[:, None], tables, 0)
    part_idx = np.zeros_like(tables)
    part_idx[:, 0] = tables[np.arange(len(lens)), nb - 1]
    return paged_mask_tensors(tables, nb, lens - 1, np.ones((len(lens), 1, 1)), part_idx[:, None, None, :],
                              (nb - 1).reshape(-1, 1, 1), full_idx[:, None, None, :], cache)


def build_flex_decode(
    context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], rows: torch.Tensor | None, cache: PagedKVCache
) -> FlexDecode:
    """The decode group's FlexAttention metadata."""
    mask = paged_block_mask(flex_decode_tensors(context_lens, block_tables, cache), 1, cache)
    return FlexDecode(rows, len(context_lens), mask)


def build_flex_chunk(row_start: int, num_tokens: int, start_pos: int, block_ids: Sequence[int],
                     cache: PagedKVCache) -> FlexChunk:
    """Block mask of one chunk whose first token is at ``start_pos`` (> 0: a cached prefix precedes it)."""
    bs = cache.shape.block_size
    q_blocks = -(-num_tokens // Q_BLOCK)
    first_q = start_pos + np.arange(q_blocks) * Q_BLOCK  # position of each query block's first token
    last_q = np.minimum(first_q + Q_BLOCK, start_pos + num_tokens) - 1
    n_full = (first_q + 1) // bs  # logical blocks wholly at or before the query block's first token
    n_seen = last_q // bs + 1  # logical blocks up to the one holding its last token
    table = np.asarray(block_ids[: int(n_seen[-1])], dtype=np.int32)
    full_idx = np.zeros((1, 1, q_blocks, len(table)), dtype=np.int32)
    part_idx = np.zeros((1, 1, q_blocks, len(table)), dtype=np.int32)
    for j in range(q_blocks):
        full_idx[0, 0, j, : n_full[j]] = table[: n_full[j]]
        part_idx[0, 0, j, : n_seen[j] - n_full[j]] = table[n_full[j] : n_seen[j]]
    tensors = paged_mask_tensors(table[None, :], np.array([len(table)]), np.array([start_pos]),
                                 (n_seen - n_full).reshape(1, 1, -1), part_idx, n_full.reshape(1, 1, -1), full_idx, cache)
    return FlexChunk(row_start, row_start + num_tokens, paged_block_mask(tensors, num_tokens, cache))


def flex_decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, group: FlexDecode,
                          fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``[B, heads * dim]`` for the group's rows of ``q`` ``[T, heads, dim]``."""
    rows = q[: group.num_seqs] if group.rows is None else q.index_select(0, group.rows)
    keys, values = cache.slot_views(layer)
    o = fn(rows[:, :, None, :], keys, values, block_mask=group.block_mask, enable_gqa=True)
    return o.reshape(group.num_seqs, -1)


def flex_chunk_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, chunk: FlexChunk,
                         fn: Callable[..., torch.Tensor], out: torch.Tensor) -> None:
    """Write the chunk's attention output into its rows of ``out`` ``[T, heads * dim]``."""
    n = chunk.row_end - chunk.row_start
    rows = q[chunk.row_start : chunk.row_end].transpose(0, 1)[None]  # [1, heads, n, dim]
    keys, values = cache.slot_views(layer)
    o = fn(rows, keys, values, block_mask=chunk.block_mask, enable_gqa=True)
    out[chunk.row_start : chunk.row_end] = o[0].transpose(0, 1).reshape(n, -1)
