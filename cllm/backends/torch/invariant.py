"""Batch-invariant kernels for ``model.deterministic`` on CPU: a row's result must not depend on how
many rows share the call, where it sits among them, or how many threads run it.

What breaks that in eager torch on a CPU, found by sweeping row counts and offsets against the same rows
computed among 600 (tests/unit/test_batch_invariant_ops.py keeps each finding asserted):

- **Matmuls** choose their kernel by shape: a few rows take another kernel than many, with its own
  accumulation order (Linear's ``pad_rows``: linear.py). Batched matmuls of a fixed per-matrix shape
  gave the same result at every batch count (1-257) and offset.
- **Reductions over a length that follows the batch**: attention's softmax and its sum over keys. Here
  keys are read in fixed tiles of ``TILE`` positions (absolute: tile t holds positions t*TILE ...); a
  sequence's query rows (token x head-in-group) meet each tile in one matmul whose rows are padded like a
  Linear's (a row's result was the same at every padded row count and batch tried, batched or not); the
  softmax runs over whole tiles (a masked key adds an exact 0 to the row's sum, and the row length is a
  multiple of the vector width, so no element moves between vector and scalar code); the values are
  summed tile by tile in order (a tile past the row's context adds an exact 0). So a row's result is the
  same whatever the longest context in its call, the number of query rows of its sequence, or the
  sequences beside it.
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

from cllm.backends.torch.linear import INVARIANT_ROWS
from cllm.backends.torch.transfer import to_device

TILE = 128  # key positions per attention tile (rounded up to whole blocks)
PIECE_TOKENS = 128  # a sequence's query tokens per piece (bounds a call's scores: any count gives the same rows)
MAX_PIECES = 64  # pieces per call (bounds the gathered K/V)
# elementwise(): at most this many elements per call (torch runs a call of <= 32,768 elements on one
# thread) in multiples of ALIGN (two AVX-512 vectors of bfloat16: the vector loop's step)
ELEMENTWISE_CHUNK = 16384
ALIGN = 64


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every element computed by torch's vector code (module docstring)."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = -(-n // ALIGN) * ALIGN
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    step = ELEMENTWISE_CHUNK
    out = torch.cat([fn(flat[i:i + step]) for i in range(0, padded, step)]) if padded > step else fn(flat)
    return out[:n].view(x.shape)


@dataclass(slots=True)
class InvariantCall:
    """Attention of ``B`` pieces of ``n`` query tokens each (each piece one sequence's consecutive tokens)."""

    rows: torch.Tensor  # [B * n] the pieces' flat rows of the step, piece by piece
    n: int  # tokens per piece
    index: torch.Tensor  # [B, kv_heads, tiles * tile_blocks] (head, block) gather index of each piece's keys
    mask: torch.Tensor  # [B, 1, padded rows, tiles * tile] True where a (token, head-in-group) row may attend


@dataclass(slots=True)
class InvariantRows:
    """A step's attention metadata for the batch-invariant path."""

    calls: list[InvariantCall]
    tile_blocks: int  # blocks per tile


def padded_rows(n: int) -> int:
    """Query rows of a piece's matmuls: padded like Linear's (a multiple of 8, at least 8)."""
    return max(INVARIANT_ROWS, -(-n // INVARIANT_ROWS) * INVARIANT_ROWS)


def build_invariant_rows(
    chunks: Sequence[tuple[int, int, int, Sequence[int]]], cache, *, q_per_kv: int, window: int | None = None,
) -> InvariantRows:
    """``chunks``: per sequence of the step, (first flat row, tokens, start position, block table).

    A chunk is cut into pieces of at most ``PIECE_TOKENS`` tokens; pieces of the same length share a call
    (at most ``MAX_PIECES`` a call): a decode step is one call, a prompt chunk a few."""
    block_size, device = cache.shape.block_size, cache.k.device
    tile_blocks = max(1, TILE // block_size)
    tile = tile_blocks * block_size
    pieces: dict[int, list[tuple[int, int, Sequence[int]]]] = {}
    for row, n, start, table in chunks:
        for i in range(0, n, PIECE_TOKENS):
            m = min(PIECE_TOKENS, n - i)
            pieces.setdefault(m, []).append((row + i, start + i, table))
    calls = []
    for n, same in pieces.items():
        for c in range(0, len(same), MAX_PIECES):
            calls.append(_call(same[c:c + MAX_PIECES], n, cache, q_per_kv, tile_blocks, tile, window, device))
    return InvariantRows(calls, tile_blocks)


def _call(pieces: list[tuple[int, int, Sequence[int]]], n: int, cache, q_per_kv: int, tile_blocks: int, tile: int,
          window: int | None, device: torch.device) -> InvariantCall:
    block_size = cache.shape.block_size
    pos = np.array([[start + j for j in range(n)] for _, start, _ in pieces])  # [B, n]
    tiles = int(pos.max()) // tile + 1
    tables = np.zeros((len(pieces), tiles * tile_blocks), dtype=np.int64)  # padding: block 0, masked out
    for b, (_, start, table) in enumerate(pieces):
        used = min(len(table), tables.shape[1], -(-(start + n) // block_size))
        tables[b, :used] = np.asarray(table[:used], dtype=np.int64)
    keys = np.arange(tiles * tile)
    allowed = keys[None, None, :] <= pos[:, :, None]  # [B, n, keys]
    if window is not None:
        allowed &= keys[None, None, :] > pos[:, :, None] - window
    rows = n * q_per_kv  # (token, head-in-group), token-major
    mask = np.ones((len(pieces), 1, padded_rows(rows), tiles * tile), dtype=bool)  # padding rows: all keys (no NaN)
    mask[:, 0, :rows] = np.repeat(allowed, q_per_kv, axis=1)
    flat = np.array([row + j for row, _, _ in pieces for j in range(n)], dtype=np.int64)
    index = cache.gather_index(tables).reshape(len(pieces), cache.shape.num_kv_heads, -1)
    return InvariantCall(to_device(flat, device), n, to_device(index, device), to_device(mask, device))


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
    for call in rows.calls:
        b, n = call.index.shape[0], call.n
        group = q.shape[1] // kv_heads
        # [B * n, heads, dim] -> [B, kv_heads, n * group rows (token-major), dim], zero rows up to the padded count
        qb = q.index_select(0, call.rows).view(b, n, kv_heads, group, dim).transpose(1, 2).reshape(b, kv_heads, -1, dim)
        padded = call.mask.shape[2]
        qb = torch.cat([qb.float(), qb.new_zeros(b, kv_heads, padded - n * group, dim, dtype=torch.float32)], dim=2)
        tiles = call.index.shape[2] // tile_blocks
        # every tile at once: [B, kv_heads, tiles, tile, dim]; one matmul of fixed-shape matrices, [padded rows,
        # dim] x [dim, tile] per (piece, kv head, tile)
        k = k_pool.index_select(0, call.index.reshape(-1)).view(b, kv_heads, tiles, tile, dim).float()
        v = v_pool.index_select(0, call.index.reshape(-1)).view(b, kv_heads, tiles, tile, dim).float()
        scores = torch.matmul(qb[:, :, None], k.transpose(-1, -2))  # [B, kv_heads, tiles, rows, tile]
        scores = scores.transpose(2, 3).reshape(b, kv_heads, padded, tiles * tile).mul_(scale)
        if softcap is not None:
            scores = elementwise(lambda x: torch.tanh(x / softcap) * softcap, scores)
        scores.masked_fill_(~call.mask, float("-inf"))
        if sinks is not None:  # one more logit per head, in a block of its own (no value): dropped after the softmax
            sink_block = scores.new_full((b, kv_heads, padded, ALIGN), float("-inf"))
            head_sinks = sinks.float().view(kv_heads, group).repeat(1, n)  # rows are (token, head-in-group)
            sink_block[:, :, :n * group, 0] = head_sinks
            probs = torch.cat([scores, sink_block], dim=-1).softmax(dim=-1)[..., :-ALIGN]
        else:
            probs = scores.softmax(dim=-1)
        probs = probs.reshape(b, kv_heads, padded, tiles, tile).transpose(2, 3)  # [B, kv_heads, tiles, rows, tile]
        # per tile [rows, tile] x [tile, dim], then the tiles summed in order (cumsum is a running sum: a tile
        # past a row's context adds an exact 0)
        o = torch.matmul(probs, v).cumsum(dim=2)[:, :, -1]
        o = o[:, :, :n * group].reshape(b, kv_heads, n, group, dim).transpose(1, 2).reshape(b * n, -1)
        out.index_copy_(0, call.rows, o.to(out.dtype))
    return out
