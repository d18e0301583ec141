"""FlexAttention over the paged KV pool: each query reads only its sequence's live blocks, in place.

A layer's head-major pool is one ``[1, kv_heads, num_blocks * block_size, dim]``
tensor (:meth:`PagedKVCache.slot_views`); a :class:`BlockMask` lists, per
sequence (batch row) and query block, which physical KV blocks it reads: the
blocks wholly before the query as *full* blocks (no mask evaluated), the
block(s) holding the query positions as *partial* ones, where ``mask_mod``
hides the slots past each query. Nothing is gathered or padded to the longest
context; the kernel walks each sequence's own block list.

- Decode group: ``q`` is ``[B, kv_heads, q_per_kv, dim]`` (the query heads that
  share a KV head on the query axis); the KV pool is shared by the batch (batch
  dim 1, broadcast). Every block of a sequence is listed as partial.
- Chunk after a cached prefix: ``q`` is ``[1, heads, n, dim]``, causal inside.
- ``mask_mod`` maps a slot back to its position through a physical -> logical
  block lookup per sequence, so it is exact by itself (the eager path, used in
  CPU tests, evaluates it everywhere and ignores the block lists) — except a
  decode group's on CUDA, exact on its own blocks only (:func:`paged_block_mask`).
- On CUDA the compiled kernels tile the KV axis by the page (:func:`kernel_options`),
  and block tables are one sequence's most blocks wide, not the pool's.

FlexAttention's eager fallback computes the dense score matrix over the whole
pool (seconds per call on a large pool), so it must run compiled for speed;
on CPU this path is selectable but not the default (benchmarks/results/performance_log_torch.md, numbers).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from cllm.backends.torch.kv_cache import PagedKVCache
from cllm.backends.torch.transfer import to_device

Q_BLOCK = 128  # query block of a chunk's mask (FlexAttention's default tile)
MAX_KV_TILE = 128  # largest KV tile of FlexAttention's CUDA kernels (pages at least this large keep the default)

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
    """flex_attention, compiled once per process when asked (the fast path); eager otherwise (tests).

    Compiled with dynamic shapes (batch, query length and pool size symbolic), so a process compiles a
    handful of variants, not one per batch size. Past dynamo's recompile limit a compiled function
    silently runs eagerly, and eager FlexAttention is dense over the whole pool (and the CUDA decode
    mask is exact only where compiled kernels evaluate it): the calls fail loudly there instead."""
    if not compiled:
        return flex_attention
    if not _compiled:
        fn = torch.compile(flex_attention, dynamic=True)

        def checked(*args: object, **kwargs: object) -> torch.Tensor:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                return fn(*args, **kwargs)

        _compiled.append(checked)
    return _compiled[0]


def _kv_index(compact: np.ndarray, cache: PagedKVCache) -> torch.Tensor:
    """Block-index table ``[B, 1, q_blocks, width]`` padded on the device to a fixed width (only the
    listed count is read): the pool's block count on CPU, where FlexAttention's eager path wants the
    tables to span the KV length, and one sequence's most blocks on CUDA (a [B, pool] table per step
    would take gigabytes at large batches)."""
    t = to_device(compact.astype(np.int32), cache.k.device)
    width = cache.shape.num_blocks if cache.k.device.type == "cpu" else cache.shape.seq_blocks
    return torch.nn.functional.pad(t, (0, width - compact.shape[-1]))


@dataclass(slots=True)
class PagedMaskTensors:
    """The device tensors a paged block mask is made of. For a decode group their shapes depend only
    on the batch size and the pool, so a CUDA graph captures them once and each step refills them."""

    part_num: torch.Tensor  # [B, 1, q_blocks] int32: partially visible blocks per query block
    part_idx: torch.Tensor  # [B, 1, q_blocks, width] int32: their physical ids (first part_num valid)
    base: torch.Tensor  # [B] int64: position of the row's first query
    full_num: torch.Tensor | None = None  # [B, 1, q_blocks] int32: wholly visible blocks per query block
    full_idx: torch.Tensor | None = None  # [B, 1, q_blocks, width] int32: their physical ids
    block_of: torch.Tensor | None = None  # [B, num_blocks] int32: logical index of each physical block in the row's table, -1 = not its
    last_block: torch.Tensor | None = None  # [B] int32: physical id of the row's last block (decode on CUDA)


def paged_mask_tensors(tables: np.ndarray, counts: np.ndarray, first_pos: np.ndarray, part_num: np.ndarray,
                       part_idx: np.ndarray, full_num: np.ndarray, full_idx: np.ndarray,
                       cache: PagedKVCache) -> PagedMaskTensors:
    """Upload compact host tables; widen and build the physical -> logical lookup on the device."""
    device, num_blocks = cache.k.device, cache.shape.num_blocks
    width = tables.shape[1]
    # padding columns of the tables scatter into a spare column past the pool, dropped after
    padded = np.where(np.arange(width)[None, :] < counts[:, None], tables, num_blocks)
    logical = torch.full((len(tables), num_blocks + 1), -1, dtype=torch.int32, device=device)
    logical.scatter_(1, to_device(padded.astype(np.int64), device),
                     torch.arange(width, dtype=torch.int32, device=device).expand(len(tables), -1).contiguous())
    block_of = logical[:, :num_blocks].contiguous()
    return PagedMaskTensors(
        to_device(part_num.astype(np.int32), device), _kv_index(part_idx, cache), to_device(first_pos.astype(np.int64), device),
        to_device(full_num.astype(np.int32), device), _kv_index(full_idx, cache), block_of,
    )


def paged_block_mask(t: PagedMaskTensors, q_len: int, cache: PagedKVCache, *, causal: bool = True) -> BlockMask:
    """The BlockMask over ``t``. With the lookup tensor its mask_mod is exact by itself (FlexAttention's
    eager path evaluates it on every slot of the pool; compiled kernels only on the listed partial
    blocks): a slot is visible to query q of row b when its block is one of b's and its position is at
    or before ``base[b] + q`` (``causal``), or at or before ``base[b]`` for every q (a decode group,
    whose q axis holds one token's query heads). A decode group on CUDA (always compiled) lists all its
    blocks as partial and has no lookup: among *its* blocks, a slot is hidden only in its last block,
    past ``base[b]``'s offset (listing no full blocks also lets the decoding kernel split the KV axis
    across programs; with full blocks it gives them all to one)."""
    bs = cache.shape.block_size
    block_of, base, last_block = t.block_of, t.base, t.last_block

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = block_of[b, kv // bs]
        return (lg >= 0) & (lg * bs + kv % bs <= base[b] + q)

    def decode_mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = block_of[b, kv // bs]
        return (lg >= 0) & (lg * bs + kv % bs <= base[b])

    def listed_decode_mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv // bs != last_block[b]) | (kv % bs <= base[b] % bs)

    if block_of is None and (causal or last_block is None):
        raise ValueError("a paged mask needs the physical -> logical lookup, or the last blocks of a decode group")
    chosen = mask_mod if causal else decode_mask_mod if block_of is not None else listed_decode_mask_mod
    return BlockMask.from_kv_blocks(
        t.part_num, t.part_idx, t.full_num, t.full_idx, BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=chosen, seq_lengths=(q_len, cache.shape.num_blocks * bs),
        compute_q_blocks=False,  # inference only: the transposed (backward) tables would be [.., num_blocks] wide
    )


def kernel_options(cache: PagedKVCache) -> dict[str, int] | None:
    """Compiled CUDA kernels tile the KV axis by BLOCK_N, which must divide the mask's KV block (the
    page): the default tile (64-128) is larger than a 16-token page, so the tile shrinks to the page."""
    bs = cache.shape.block_size
    if cache.k.device.type != "cuda" or bs >= MAX_KV_TILE:
        return None
    return {"BLOCK_N": bs}


def decode_mask_arrays(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                       cache: PagedKVCache, *, lookup: bool | None = None) -> dict[str, np.ndarray]:
    """Host arrays of a decode group's :class:`PagedMaskTensors` fields: sequence b reads its first
    ``ceil(len_b / block_size)`` blocks, all listed as partial; with the lookup (default: on CPU) or
    the last block's id (default on CUDA; see :func:`paged_block_mask`)."""
    if lookup is None:
        lookup = cache.k.device.type == "cpu"
    bs = cache.shape.block_size
    lens = np.asarray(context_lens, dtype=np.int64)
    nb = -(-lens // bs)
    n = len(lens)
    width = cache.shape.num_blocks if cache.k.device.type == "cpu" else cache.shape.seq_blocks
    tables = np.zeros((n, width), dtype=np.int32)
    # One scatter for the whole batch (a slice assignment per row was ~0.5 ms of each 256-row step).
    counts = nb.tolist()
    flat = np.fromiter(itertools.chain.from_iterable(t[:k] for t, k in zip(block_tables, counts)), dtype=np.int32,
                       count=int(nb.sum()))
    starts = np.cumsum(nb) - nb
    cols = np.arange(len(flat)) - np.repeat(starts, nb)
    tables[np.repeat(np.arange(n), nb), cols] = flat
    arrays = {"part_num": nb.astype(np.int32).reshape(n, 1, 1), "part_idx": tables.reshape(n, 1, 1, width),
              "base": lens - 1}
    if lookup:
        block_of = np.full((n, cache.shape.num_blocks), -1, dtype=np.int32)
        for b, k in enumerate(nb):
            block_of[b, tables[b, :k]] = np.arange(k, dtype=np.int32)
        arrays["block_of"] = block_of
    else:
        arrays["last_block"] = tables[np.arange(n), nb - 1]
    return arrays


def flex_decode_tensors(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                        cache: PagedKVCache) -> PagedMaskTensors:
    """A decode group's mask tensors, uploaded (one copy per field)."""
    arrays = decode_mask_arrays(context_lens, block_tables, cache)
    return PagedMaskTensors(**{name: to_device(a, cache.k.device) for name, a in arrays.items()})


def build_flex_decode(
    context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], rows: torch.Tensor | None, cache: PagedKVCache,
    q_per_kv: int,
) -> FlexDecode:
    """The decode group's FlexAttention metadata (its queries are packed ``q_per_kv`` per KV head)."""
    mask = paged_block_mask(flex_decode_tensors(context_lens, block_tables, cache), q_per_kv, cache, causal=False)
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
    """``[B, heads * dim]`` for the group's rows of ``q`` ``[T, heads, dim]``.

    Each sequence's query heads that share a KV head go on the query axis (``[B, kv_heads, q_per_kv,
    dim]``, query head h reads KV head h // q_per_kv as in grouped-query attention): one program per
    KV head reads its keys once for all of them, and FlexAttention's decoding kernel (short query axis,
    no GQA broadcast) applies whatever the ratio (it needs a power of two under ``enable_gqa``)."""
    rows = q[: group.num_seqs] if group.rows is None else q.index_select(0, group.rows)
    keys, values = cache.slot_views(layer)
    b, heads, dim = rows.shape
    packed = rows.reshape(b, keys.shape[1], heads // keys.shape[1], dim)
    o = fn(packed, keys, values, block_mask=group.block_mask, kernel_options=kernel_options(cache))
    return o.reshape(b, -1)


def flex_chunk_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, chunk: FlexChunk,
                         fn: Callable[..., torch.Tensor], out: torch.Tensor) -> None:
    """Write the chunk's attention output into its rows of ``out`` ``[T, heads * dim]``."""
    n = chunk.row_end - chunk.row_start
    rows = q[chunk.row_start : chunk.row_end].transpose(0, 1)[None]  # [1, heads, n, dim]
    keys, values = cache.slot_views(layer)
    o = fn(rows, keys, values, block_mask=chunk.block_mask, enable_gqa=True, kernel_options=kernel_options(cache))
    out[chunk.row_start : chunk.row_end] = o[0].transpose(0, 1).reshape(n, -1)
