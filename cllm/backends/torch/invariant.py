"""Batch-invariant kernels for ``model.deterministic`` on CPU: a row's result must not depend on how
many rows share the call, where it sits among them, or how many threads run it.

What breaks that in eager torch on a CPU, found by sweeping row counts and offsets against the same rows
computed among 600 (tests/unit/test_batch_invariant_ops.py keeps each finding asserted):

- **Matmuls** choose their kernel by shape: a few rows take another kernel than many, with its own
  accumulation order (Linear's ``pad_rows``: linear.py). Batched matmuls of a fixed per-matrix shape
  gave the same result at every batch count (1-257) and offset.
- **Reductions over a length that follows the batch**: attention's softmax and its sum over keys. Here
  every query row reads its keys in fixed tiles of ``TILE`` positions (absolute: tile t holds positions
  t*TILE ...), scores are one fixed-shape batched matmul per tile, the softmax runs over whole tiles (a
  masked key adds an exact 0 to the row's sum, the row length is a multiple of the vector width, so no
  element moves between vector and scalar code), and the values are summed tile by tile in order (a tile
  past the row's context adds an exact 0). So a row's result is the same whatever the longest context
  in its call, the number of its query rows, or the rows beside it.
- **Elementwise transcendental functions** (SiLU, GELU, the rotary tables' cos/sin): torch runs them on
  vectors, and the last few elements of each thread's share on scalar code (glibc's ``exp`` against
  Sleef's: 16-40 of 512 single-element SiLU/GELU calls differ in the last bit). Where the shares end
  follows the tensor's size, so a row's activations followed its batch (hidden size 1000: 126 of 199 row
  counts). :func:`elementwise` applies them in pieces small enough for one thread and aligned to whole
  vectors, so every element takes the vector code.

Row-wise kernels (RMSNorm, softmax over a fixed length, log-softmax of the sampler) reduce each row on
its own with fixed-length vector code: invariant as they are (asserted by the same tests).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cllm.backends.torch.transfer import to_device

TILE = 256  # key positions per attention tile (rounded up to whole blocks)
ROWS = 64  # query rows per attention call (any count gives the same rows: it bounds the gathered K/V)
# elementwise(): at most this many elements per call (torch runs a call of <= 32,768 elements on one
# thread) in multiples of ALIGN (two AVX-512 vectors of bfloat16: the vector loop's step)
PIECE = 16384
ALIGN = 64


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every element computed by torch's vector code (module docstring)."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = -(-n // ALIGN) * ALIGN
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    out = torch.cat([fn(flat[i:i + PIECE]) for i in range(0, padded, PIECE)]) if padded > PIECE else fn(flat)
    return out[:n].view(x.shape)


@dataclass(slots=True)
class InvariantRows:
    """A step's attention metadata for the batch-invariant path: every query row on its own."""

    index: torch.Tensor  # [T, kv_heads, tiles * tile_blocks] (head, block) gather index of each row's keys
    mask: torch.Tensor  # [T, tiles * tile] True where the row may attend the key
    tile_blocks: int  # blocks per tile
    groups: list[tuple[int, int, int, int]]  # (first row, end row, first tile, end tile) of each call


def build_invariant_rows(
    positions: Sequence[tuple[int, int, Sequence[int]]], cache, *, window: int | None = None,
) -> InvariantRows:
    """``positions``: per chunk of the step (row order), (start position, tokens, block table)."""
    block_size, device = cache.shape.block_size, cache.k.device
    tile_blocks = max(1, TILE // block_size)
    tile = tile_blocks * block_size
    pos = np.concatenate([np.arange(start, start + n) for start, n, _ in positions])
    tiles = int(pos.max()) // tile + 1
    tables = np.zeros((len(pos), tiles * tile_blocks), dtype=np.int64)  # padding: block 0, masked out
    row = 0
    for start, n, table in positions:
        used = min(len(table), tables.shape[1], -(-(start + n) // block_size))
        tables[row:row + n, :used] = np.asarray(table[:used], dtype=np.int64)
        row += n
    keys = np.arange(tiles * tile)
    mask = keys[None, :] <= pos[:, None]
    first_tile = np.zeros_like(pos)
    if window is not None:
        mask &= keys[None, :] > pos[:, None] - window
        first_tile = np.maximum(pos - window + 1, 0) // tile
    groups = []
    for g0 in range(0, len(pos), ROWS):
        g1 = min(len(pos), g0 + ROWS)
        groups.append((g0, g1, int(first_tile[g0:g1].min()), int(pos[g0:g1].max()) // tile + 1))
    index = cache.gather_index(tables).reshape(len(pos), cache.shape.num_kv_heads, -1)
    return InvariantRows(to_device(index, device), to_device(mask, device), tile_blocks, groups)


def invariant_attention(q: torch.Tensor, cache, layer: int, rows: InvariantRows, scale: float | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v of every query row over its own keys, ``[T, heads * dim]``, in float32 inside
    (module docstring); ``softcap`` and ``sinks`` as matmul_attention's extras."""
    s = cache.shape
    kv_heads, dim, tile_blocks = s.num_kv_heads, s.head_dim, rows.tile_blocks
    tile = tile_blocks * s.block_size
    scale = dim ** -0.5 if scale is None else scale
    k_pool = cache.k[layer].view(-1, s.block_size, dim)
    v_pool = cache.v[layer].view(-1, s.block_size, dim)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for g0, g1, t0, t1 in rows.groups:
        n = g1 - g0
        qg = q[g0:g1].reshape(n, kv_heads, -1, dim).float()
        group = qg.shape[2]
        parts, values = [], []
        for t in range(t0, t1):  # one fixed-shape matmul per tile: [group, dim] x [dim, tile] per (row, kv head)
            index = rows.index[g0:g1, :, t * tile_blocks:(t + 1) * tile_blocks].reshape(-1)
            k = k_pool.index_select(0, index).view(n, kv_heads, tile, dim).float()
            values.append(v_pool.index_select(0, index).view(n, kv_heads, tile, dim).float())
            parts.append(torch.matmul(qg, k.transpose(-1, -2)))
        scores = torch.cat(parts, dim=-1).mul_(scale)
        if softcap is not None:
            scores = elementwise(lambda x: torch.tanh(x / softcap) * softcap, scores)
        scores.masked_fill_(~rows.mask[g0:g1, None, None, t0 * tile:t1 * tile], float("-inf"))
        if sinks is not None:  # one more logit per head, in a tile of its own (no value): dropped after the softmax
            sink_tile = scores.new_full((n, kv_heads, group, ALIGN), float("-inf"))
            sink_tile[..., 0] = sinks.float().view(1, kv_heads, group)
            probs = torch.cat([scores, sink_tile], dim=-1).softmax(dim=-1)[..., :-ALIGN]
        else:
            probs = scores.softmax(dim=-1)
        o = None
        for i, v in enumerate(values):  # tile by tile, in order: a tile past the row's context adds exact zeros
            part = torch.matmul(probs[..., i * tile:(i + 1) * tile].contiguous(), v)
            o = part if o is None else o.add_(part)
        out[g0:g1] = o.reshape(n, -1).to(out.dtype)
    return out
