"""The paged KV tensors: one preallocated pool of blocks per layer, shared by all sequences.

Which sequence owns which block is :class:`BlockManager`'s business; this file
only stores K/V by slot (``block_id * block_size + offset``) and gathers whole
blocks back by block table.

Two block layouts:

- head-major ``[kv_heads, num_blocks, block_size, head_dim]`` (SDPA and
  FlexAttention paths): a gather by (head, block) index lands directly as
  ``[B, kv_heads, tokens, dim]``, contiguous, which is what attention kernels
  read fastest — measured 15-45% faster decode attention on CPU than a
  transposed token-major gather. Heads outermost make a layer's pool one
  ``[1, kv_heads, num_blocks * block_size, head_dim]`` view, which
  FlexAttention reads in place through a paged block mask (no gather).
- token-major ``[num_blocks, block_size, kv_heads, head_dim]`` (flash-attn's
  paged kernel reads this layout itself).

Both are written through one flat view ``[-1, head_dim]``: each new token
contributes one row per KV head, at indices from :meth:`PagedKVCache.write_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, frozen=True)
class KVCacheShape:
    """Geometry of the pool."""

    num_layers: int  # decoder layers, each with its own K and V pool
    num_blocks: int  # blocks per layer
    block_size: int  # token slots per block
    num_kv_heads: int  # key/value heads
    head_dim: int  # per-head width
    max_seq_blocks: int = 0  # most blocks one sequence can hold (0 = num_blocks)

    @property
    def seq_blocks(self) -> int:
        return self.max_seq_blocks or self.num_blocks


class PagedKVCache:
    """K and V block pools for every layer, in head-major or token-major block layout."""

    def __init__(self, shape: KVCacheShape, *, dtype: torch.dtype, device: torch.device, head_major: bool) -> None:
        self.shape = shape
        self.head_major = head_major
        s = shape
        shape = ((s.num_kv_heads, s.num_blocks, s.block_size, s.head_dim) if head_major
                 else (s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim))
        self.k = torch.zeros((s.num_layers, *shape), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write_rows(self, slots: np.ndarray) -> np.ndarray:
        """Flat row (in a layer's ``[-1, head_dim]`` view) of each (token, kv head), token-major order."""
        s = self.shape
        heads = np.arange(s.num_kv_heads)
        if not self.head_major:
            return (slots[:, None] * s.num_kv_heads + heads).reshape(-1)
        return (heads[None, :] * (s.num_blocks * s.block_size) + slots[:, None]).reshape(-1)

    def gather_index(self, block_tables: np.ndarray) -> np.ndarray:
        """Head-major only: (head, block) pairs of ``block_tables`` ``[B, nb]``, ordered ``[B, kv_heads, nb]``."""
        heads = np.arange(self.shape.num_kv_heads)[None, :, None]
        return (heads * self.shape.num_blocks + block_tables[:, None, :]).reshape(-1)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' ``k``/``v`` (``[tokens, kv_heads, dim]``) at ``rows`` from :meth:`write_rows`."""
        dim = self.shape.head_dim
        self.k[layer].view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))

    def gather(self, layer: int, index: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks at ``index`` (:meth:`gather_index`) as ``[batch, kv_heads, tokens, dim]``."""
        s = self.shape
        shape = (batch, s.num_kv_heads, -1, s.head_dim)
        k = self.k[layer].view(-1, s.block_size, s.head_dim).index_select(0, index).view(shape)
        v = self.v[layer].view(-1, s.block_size, s.head_dim).index_select(0, index).view(shape)
        return k, v

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``rows`` (:meth:`write_rows`) as ``[tokens, kv_heads, dim]`` (state snapshots)."""
        s = self.shape
        k = self.k[layer].view(-1, s.head_dim).index_select(0, rows)
        v = self.v[layer].view(-1, s.head_dim).index_select(0, rows)
        return k.view(-1, s.num_kv_heads, s.head_dim), v.view(-1, s.num_kv_heads, s.head_dim)

    def block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of one block's K and V in every layer, ``[layers, *block]`` in the pool's
        layout: what a KV hand-off reads from one engine's pool and writes into another's."""
        index = (slice(None), slice(None), block_id) if self.head_major else (slice(None), block_id)
        return self.k[index], self.v[index]

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pools as stored (token-major: what paged kernels read)."""
        return self.k[layer], self.v[layer]

    def slot_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head-major only: the layer's K and V as ``[1, kv_heads, num_blocks * block_size, dim]`` (no copy)."""
        s = self.shape
        shape = (1, s.num_kv_heads, s.num_blocks * s.block_size, s.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)
