"""Attention over the paged KV cache for one flat varlen batch.

A step mixes decode tokens (one per sequence) and prefill chunks (many tokens
of one sequence, possibly after a cached prefix). The per-step metadata is built
once (:func:`build_attention_batch`) and shared by every layer:

- Every path: a chunk with nothing cached before it (a fresh prefill) attends
  over its own fresh K/V with SDPA's causal kernel (``is_causal``, GQA native):
  no mask is built.
- SDPA path (the CPU default): all one-token sequences form one
  padded group: their K/V are gathered block-wise by block table into
  ``[B, kv_heads, max_len, dim]`` with a length mask, and one attention call
  serves them all. A chunk after a cached prefix gets its own call with a
  causal position mask over its gathered blocks. Grouped-query heads are
  folded into the query-length axis (``[B, kv_heads, group * q_len, dim]``) so
  K/V are never repeated per head.
- FlexAttention path (the CUDA default, selectable on CPU): the decode group
  and each chunk after a cached prefix read their live blocks in place through
  a paged block mask (:mod:`flex`): nothing gathered, nothing padded.
- flash-attn path (CUDA, flash_attn installed, block_size a multiple of 256 as
  its paged kernel requires): one ``flash_attn_varlen_func`` call over the
  whole batch, reading K/V straight from the block pool.

What a model asks of attention beyond softmax(q k^T / sqrt(d)) v (issue 40) is served on the SDPA path:
a sliding window per layer (:class:`AttentionBatch` ``windowed``: metadata built once per distinct window,
reading only the blocks the window covers), and :class:`AttentionExtras` (its own scale, logit
softcapping, attention sinks), which swap SDPA for the matmul + softmax formulation where SDPA has no
such option.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cllm.backends.torch.flex import (
    FlexChunk, FlexDecode, build_flex_chunk, build_flex_decode, flex_chunk_attention, flex_decode_attention,
)
from cllm.backends.torch.invariant import InvariantRows, build_invariant_rows, invariant_attention
from cllm.backends.torch.kv_cache import PagedKVCache
from cllm.backends.torch.transfer import to_device

try:  # optional CUDA kernels
    from flash_attn import flash_attn_varlen_func
except ImportError:  # the SDPA path serves every device
    flash_attn_varlen_func = None

FLASH_PAGE_MULTIPLE = 256  # flash-attn's paged KV needs page sizes divisible by this
# On CPU, torch's flash-SDPA kernel is tuned for long query blocks; for a decode
# group (3 folded query rows per kv head) plain matmul + softmax beat it once the
# gathered keys are this many or more (B * max_len), and lose below (benchmarks/results/performance_log_torch.md).
MATMUL_DECODE_MIN_KEYS = 512
# On the FlexAttention path, a chunk after a cached prefix whose context (prefix + chunk) is at most this
# long is attended with SDPA over its gathered blocks rather than with FlexAttention. A compiled
# FlexAttention call costs a few hundred microseconds of host time per layer (dynamo's guards and
# wrappers; cProfile on an H200: 330 µs), paid per chunk and layer: 1,024 calls for 64 requests whose
# prompts hit the prefix cache, most of a 64-stream server's step time. The gather of a short context
# costs a few kernels; past this length its copy grows and FlexAttention's in-place read wins.
FLEX_CHUNK_MIN_CONTEXT = 8192
# A chunk after a cached prefix of at most this many tokens joins the decode group (see is_tail): each of
# its tokens reads the whole context once, so long chunks keep their own (block-wise) call.
MAX_TAIL_TOKENS = 32


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step, as the backend hands it over."""

    row_start: int  # first flat row of the sequence's tokens in this step
    num_tokens: int  # its tokens this step
    start_pos: int  # position of its first token (= its tokens already in KV)
    block_ids: Sequence[int]  # its block table (covers start_pos + num_tokens tokens)
    # [start, end) position ranges whose tokens see each other both ways (a Gemma 3 image's tokens); SDPA path
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class DecodeGroup:
    """All one-token sequences of a step, attended in one padded call."""

    rows: torch.Tensor | None  # flat rows of their tokens; None = the whole step is this group (rows 0..B-1)
    num_seqs: int  # B
    gather_index: torch.Tensor  # (block, head) index of their padded block tables, [B * kv_heads * max_blocks]
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] True where a key may be attended


@dataclass(slots=True)
class PrefillChunk:
    """One multi-token chunk, attended on its own."""

    row_start: int  # first flat row
    row_end: int  # one past its last flat row
    gather_index: torch.Tensor | None  # (head, block) index of its whole context; None = no earlier context (fresh K/V)
    mask: torch.Tensor | None  # [1, 1, group * q_len, keys] True where a key's position <= the query's; None = fresh (causal kernel)


@dataclass(slots=True)
class FlashBatch:
    """Arguments of one flash_attn_varlen_func call over the whole step."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32 query offsets
    cu_seqlens_k: torch.Tensor  # [B + 1] int32 context offsets (cached + new tokens)
    max_seqlen_q: int  # longest chunk
    max_seqlen_k: int  # longest context
    block_tables: torch.Tensor  # [B, max_blocks] int32


@dataclass(slots=True)
class AttentionBatch:
    """Everything attention needs for one step, shared by all layers."""

    write_rows: torch.Tensor  # [T * kv_heads] cache rows of the new tokens' K/V (PagedKVCache.write_rows)
    decode: DecodeGroup | FlexDecode | None  # the one-token sequences (SDPA or FlexAttention path)
    prefills: list[PrefillChunk | FlexChunk]  # the multi-token chunks
    flash: FlashBatch | None  # set when the flash-attn path serves the whole step
    flex_fn: Callable[..., torch.Tensor] | None = None  # flex_attention (compiled or eager) for Flex* parts
    # The same step for layers with a sliding window of W tokens (a query at position p sees keys
    # p - W + 1 .. p, as transformers' sliding masks), by W; SDPA path only.
    windowed: dict[int, AttentionBatch] = field(default_factory=dict)
    # model.deterministic: every query row attended on its own over fixed key tiles (invariant.py)
    invariant: InvariantRows | None = None

    def for_window(self, window: int | None) -> AttentionBatch:
        """The metadata of a layer with this sliding window (None: full attention). A window without
        metadata of its own is one no sequence can outgrow (the backend builds every window shorter
        than its longest context), so full attention is the same attention."""
        return self.windowed.get(window, self) if window is not None else self


@dataclass(slots=True, frozen=True)
class AttentionExtras:
    """A layer's departures from plain scaled dot-product attention."""

    scale: float | None = None  # the scores' factor; None: 1 / sqrt(head_dim)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)
    sinks: torch.Tensor | None = None  # [heads] float32: one extra logit per head in the softmax, no value (gpt-oss)

    @property
    def plain(self) -> bool:
        """Whether SDPA serves it (its scale is an SDPA argument)."""
        return self.softcap is None and self.sinks is None


def flash_usable(device: torch.device, block_size: int) -> bool:
    """Whether the flash-attn paged kernel can serve this cache."""
    return flash_attn_varlen_func is not None and device.type == "cuda" and block_size % FLASH_PAGE_MULTIPLE == 0


def attention_mode(setting: str, device: torch.device, block_size: int) -> str:
    """The attention path: ``auto`` = flash-attn's paged kernel on CUDA when usable, else FlexAttention
    on CUDA; SDPA on CPU (compiled FlexAttention is no faster there and costs a compile, benchmarks/results/performance_log_torch.md)."""
    if setting == "flash" and not flash_usable(device, block_size):
        raise ValueError(
            f"attention='flash' needs CUDA, the flash_attn package and block_size % {FLASH_PAGE_MULTIPLE} == 0 "
            f"(device {device}, block_size {block_size})"
        )
    if setting != "auto":
        mode = setting
    elif device.type == "cuda":
        mode = "flash" if flash_usable(device, block_size) else "flex"
    else:
        mode = "sdpa"
    if mode == "flex" and device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size {block_size}: FlexAttention on CUDA tiles the KV axis by the page, "
                         "which must be a power of two of at least 16")
    return mode


def slot_mapping(chunks: Sequence[SeqChunk], block_size: int) -> np.ndarray:
    """Flat cache slot (block_id * block_size + offset) of every new token, in row order."""
    if all(c.num_tokens == 1 for c in chunks):  # a decode step: one slot per sequence
        pos = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
        blocks = np.fromiter((c.block_ids[c.start_pos // block_size] for c in chunks), dtype=np.int64, count=len(chunks))
        return blocks * block_size + pos % block_size
    parts = []
    for c in chunks:
        pos = np.arange(c.start_pos, c.start_pos + c.num_tokens)
        table = np.asarray(c.block_ids, dtype=np.int64)
        parts.append(table[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(parts)


def build_attention_batch(
    chunks: Sequence[SeqChunk], cache: PagedKVCache, *, q_per_kv: int, mode: str,
    flex_fn: Callable[..., torch.Tensor] | None = None, windows: Sequence[int] = (),
) -> AttentionBatch:
    """Per-step attention metadata (one host-to-device copy per tensor, reused by every layer).

    ``mode``: ``sdpa``, ``flex`` (needs ``flex_fn``) or ``flash``. ``windows``: the sliding windows
    of the model's layers (SDPA only), each given its own metadata in ``windowed``.
    """
    batch = _build(chunks, cache, q_per_kv=q_per_kv, mode=mode, flex_fn=flex_fn)
    if windows and mode not in ("sdpa", "invariant"):
        raise ValueError(f"sliding-window attention runs on the SDPA path, not {mode!r}")
    for window in windows:
        batch.windowed[window] = _build(chunks, cache, q_per_kv=q_per_kv, mode=mode, window=window,
                                        rows=batch.write_rows)
    return batch


def _build(
    chunks: Sequence[SeqChunk], cache: PagedKVCache, *, q_per_kv: int, mode: str,
    flex_fn: Callable[..., torch.Tensor] | None = None, window: int | None = None, rows: torch.Tensor | None = None,
) -> AttentionBatch:
    device = cache.k.device
    block_size = cache.shape.block_size
    if rows is None:
        rows = to_device(cache.write_rows(slot_mapping(chunks, block_size)), device)
    if mode == "flash":
        return AttentionBatch(rows, None, [], _flash_batch(chunks, block_size, device))
    if mode == "invariant":
        return AttentionBatch(rows, None, [], None, invariant=build_invariant_rows(
            [(c.row_start, c.num_tokens, c.start_pos, c.block_ids) for c in chunks], cache, q_per_kv=q_per_kv,
            window=window))
    single = [c for c in chunks if c.num_tokens == 1]
    whole = len(single) == len(chunks)
    tails = [c for c in chunks if is_tail(c)]
    if tails:  # each tail token joins the decode group as a one-token query at its own position
        single += [SeqChunk(c.row_start + i, 1, c.start_pos + i, c.block_ids) for c in tails for i in range(c.num_tokens)]
    multi = [c for c in chunks if c.num_tokens > 1 and not is_tail(c)]
    if mode == "flex":
        decode = _flex_decode(single, cache, whole, q_per_kv) if single else None
        prefills = [_flex_or_gathered_chunk(c, cache, q_per_kv) for c in multi]
        return AttentionBatch(rows, decode, prefills, None, flex_fn)
    decode = _decode_group(single, cache, whole_batch=whole, window=window) if single else None
    prefills = [_prefill_chunk(c, cache, q_per_kv, window) for c in multi]
    return AttentionBatch(rows, decode, prefills, None)


def is_tail(c: SeqChunk) -> bool:
    """A short chunk after a cached prefix (a prompt whose start hit the prefix cache): attended as
    one-token queries in the step's decode group rather than by a call of its own per layer. Its K/V
    are written before attention runs, and each of its queries sees exactly the positions up to its
    own, as a decode does. On an H200, 256 such chunks (a burst sharing a prompt) cost a second of
    host time as 4,096 separate attention calls (16 layers), versus one call per layer this way."""
    return c.start_pos > 0 and 1 < c.num_tokens <= MAX_TAIL_TOKENS and not c.bidirectional


def _flex_decode(single: Sequence[SeqChunk], cache: PagedKVCache, whole_batch: bool, q_per_kv: int) -> FlexDecode:
    rows = None if whole_batch else to_device(np.array([c.row_start for c in single]), cache.k.device)
    return build_flex_decode([c.start_pos + 1 for c in single], [c.block_ids for c in single], rows, cache, q_per_kv)


def _flex_or_gathered_chunk(c: SeqChunk, cache: PagedKVCache, q_per_kv: int) -> PrefillChunk | FlexChunk:
    """A multi-token chunk on the FlexAttention path: fresh (causal SDPA), short context (SDPA over its
    gathered blocks) or long context (FlexAttention in place); see FLEX_CHUNK_MIN_CONTEXT."""
    if c.start_pos == 0 or c.start_pos + c.num_tokens <= FLEX_CHUNK_MIN_CONTEXT:
        return _prefill_chunk(c, cache, q_per_kv)
    return build_flex_chunk(c.row_start, c.num_tokens, c.start_pos, c.block_ids, cache)


def _fresh_chunk(c: SeqChunk, window: int | None = None, device: torch.device | None = None) -> PrefillChunk:
    """A chunk at position 0: causal attention over its own K/V, no mask (a token-by-token mask when
    a sliding window is shorter than the chunk)."""
    mask = None
    if (window is not None and c.num_tokens > window) or c.bidirectional:
        pos = np.arange(c.num_tokens)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        mask = to_device(_both_ways(allowed, pos, pos, c.bidirectional), device)
    return PrefillChunk(c.row_start, c.row_start + c.num_tokens, None, mask)


def _both_ways(allowed: np.ndarray, q_pos: np.ndarray, keys: np.ndarray,
               ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """``allowed`` with every query in a range also seeing the range's later keys (as transformers' Gemma 3
    attends an image's tokens to each other)."""
    for start, end in ranges:
        allowed |= ((q_pos >= start) & (q_pos < end))[:, None] & ((keys >= start) & (keys < end))[None, :]
    return allowed


def _padded_tables(chunks: Sequence[SeqChunk], num_blocks: Sequence[int]) -> np.ndarray:
    tables = np.zeros((len(chunks), max(num_blocks)), dtype=np.int64)
    for i, (c, n) in enumerate(zip(chunks, num_blocks)):
        tables[i, :n] = c.block_ids[:n]
    return tables


def _window_start(context: np.ndarray, window: int | None, block_size: int) -> np.ndarray:
    """First block each query row must read: 0, or the block holding the oldest key its window covers."""
    if window is None:
        return np.zeros_like(context)
    return np.maximum(context - window, 0) // block_size


def _decode_group(single: Sequence[SeqChunk], cache: PagedKVCache, *, whole_batch: bool,
                  window: int | None = None) -> DecodeGroup:
    device, block_size = cache.k.device, cache.shape.block_size
    context = np.array([c.start_pos + 1 for c in single])
    first = _window_start(context, window, block_size)  # blocks behind a sliding window are not read
    last = -(-context // block_size)
    tables = np.zeros((len(single), int((last - first).max())), dtype=np.int64)  # padding: block 0, masked out
    for i, c in enumerate(single):
        tables[i, : last[i] - first[i]] = c.block_ids[first[i] : last[i]]
    keys = first[:, None] * block_size + np.arange(tables.shape[1] * block_size)[None, :]  # each key's position
    mask = keys < context[:, None]
    if window is not None:
        mask &= keys >= context[:, None] - window
    mask = mask.reshape(len(single), 1, 1, -1)
    # A pure decode step has one row per sequence, in order: no gather/scatter of rows needed.
    rows = None if whole_batch else to_device(np.array([c.row_start for c in single]), device)
    index = to_device(cache.gather_index(tables), device)
    return DecodeGroup(rows, len(single), index, to_device(mask, device))


def _prefill_chunk(c: SeqChunk, cache: PagedKVCache, q_per_kv: int, window: int | None = None) -> PrefillChunk:
    if c.start_pos == 0:  # nothing cached before it: the causal kernel over its own fresh K/V
        return _fresh_chunk(c, window, cache.k.device)
    device, block_size = cache.k.device, cache.shape.block_size
    context = c.start_pos + c.num_tokens
    q_pos = np.arange(c.start_pos, context)
    first = int(_window_start(np.array([c.start_pos + 1]), window, block_size)[0])  # the first query's window
    nb = -(-context // block_size)
    table = np.asarray(c.block_ids[first:nb], dtype=np.int64)[None, :]
    index, keys = to_device(cache.gather_index(table), device), first * block_size + np.arange((nb - first) * block_size)
    allowed = keys[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= keys[None, :] > q_pos[:, None] - window
    allowed = _both_ways(allowed, q_pos, keys, c.bidirectional)
    # Folded GQA: query rows are (head-in-group, token), so the token mask repeats per head.
    mask = np.tile(allowed, (q_per_kv, 1))[None, None]
    return PrefillChunk(c.row_start, c.row_start + c.num_tokens, index, to_device(mask, device))


def _flash_batch(chunks: Sequence[SeqChunk], block_size: int, device: torch.device) -> FlashBatch:
    q_lens = np.array([c.num_tokens for c in chunks])
    k_lens = np.array([c.start_pos + c.num_tokens for c in chunks])
    tables = _padded_tables(chunks, [-(-n // block_size) for n in k_lens])

    def cumulative(lens: np.ndarray) -> torch.Tensor:
        return to_device(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), device)

    return FlashBatch(
        cumulative(q_lens), cumulative(k_lens), int(q_lens.max()), int(k_lens.max()),
        to_device(tables.astype(np.int32), device),
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, layer: int, batch: AttentionBatch,
    extras: AttentionExtras | None = None,
) -> torch.Tensor:
    """Store the step's new K/V, then attend each token over its sequence's context.

    q: ``[T, heads, dim]``; k, v: ``[T, kv_heads, dim]``. Returns ``[T, heads * dim]``. ``batch`` is
    the layer's own (:meth:`AttentionBatch.for_window`); ``extras`` what else the layer asks for.
    """
    cache.write(layer, batch.write_rows, k, v)
    if batch.invariant is not None:
        return invariant_attention(q, cache, layer, batch.invariant, *(() if extras is None else (
            extras.scale, extras.softcap, extras.sinks)))
    if extras is not None and (batch.flash is not None or batch.flex_fn is not None):
        raise ValueError("attention scale, softcapping and sinks run on the SDPA path")
    if batch.flash is not None:
        return _flash_attention(q, cache, layer, batch.flash)
    if batch.decode is not None and batch.decode.rows is None:
        return _any_decode(q, cache, layer, batch, extras)  # a pure decode step: no scatter
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if batch.decode is not None:
        out.index_copy_(0, batch.decode.rows, _any_decode(q, cache, layer, batch, extras))
    for chunk in batch.prefills:
        if isinstance(chunk, FlexChunk):
            flex_chunk_attention(q, cache, layer, chunk, batch.flex_fn, out)  # type: ignore[arg-type]
        elif chunk.gather_index is None:
            _fresh_attention(q, k, v, chunk, out, extras)
        else:
            _prefill_attention(q, cache, layer, chunk, out, extras)
    return out


def _any_decode(q: torch.Tensor, cache: PagedKVCache, layer: int, batch: AttentionBatch,
                extras: AttentionExtras | None) -> torch.Tensor:
    if isinstance(batch.decode, FlexDecode):
        return flex_decode_attention(q, cache, layer, batch.decode, batch.flex_fn)  # type: ignore[arg-type]
    return _decode_attention(q, cache, layer, batch.decode, extras)  # type: ignore[arg-type]


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, out: torch.Tensor,
                     extras: AttentionExtras | None) -> None:
    """Causal SDPA of a chunk with no earlier context, over its own K/V (native GQA; no mask tensor
    unless a sliding window is shorter than the chunk)."""
    n = chunk.row_end - chunk.row_start
    sl = slice(chunk.row_start, chunk.row_end)
    rows, keys, values = q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
    if extras is not None and not extras.plain:
        group = rows.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        mask = chunk.mask if chunk.mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
        sinks = None if extras.sinks is None else extras.sinks.view(1, -1, 1, 1)
        o = matmul_attention(rows, keys, values, mask, extras, sinks)
    else:
        o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           enable_gqa=True, scale=None if extras is None else extras.scale)
    out[sl] = o[0].transpose(0, 1).reshape(n, -1)


def _decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, group: DecodeGroup,
                      extras: AttentionExtras | None) -> torch.Tensor:
    """Attention of the one-token sequences, ``[B, heads * dim]`` in group order."""
    n, kv_heads, dim = group.num_seqs, cache.shape.num_kv_heads, cache.shape.head_dim
    rows = q[:n] if group.rows is None else q.index_select(0, group.rows)
    # [B, heads, dim] -> [B, kv_heads, group, dim]: a kv head's query heads are adjacent.
    rows = rows.view(n, kv_heads, -1, dim)
    keys, values = cache.gather(layer, group.gather_index, n)
    plain = extras is None or extras.plain
    if not plain or (q.device.type == "cpu" and n * keys.shape[2] >= MATMUL_DECODE_MIN_KEYS):
        sinks = None if extras is None or extras.sinks is None else extras.sinks.view(1, kv_heads, -1, 1)
        o = matmul_attention(rows, keys, values, group.mask, extras, sinks)
    else:
        o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=group.mask,
                                           scale=None if extras is None else extras.scale)
    return o.reshape(n, -1)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      extras: AttentionExtras | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v with the softmax in float32 (as transformers' eager attention); with
    ``extras``' softcap applied to the scores before the mask (Gemma 2), and ``sinks`` (broadcast to
    the scores' rows, one logit each) joining the softmax and dropped after it (gpt-oss)."""
    scale = q.shape[-1] ** -0.5 if extras is None or extras.scale is None else extras.scale
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if extras is not None and extras.softcap is not None:
        scores = scores.div_(extras.softcap).tanh_().mul_(extras.softcap)
    scores = scores.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        probs = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, chunk: PrefillChunk, out: torch.Tensor,
                       extras: AttentionExtras | None) -> None:
    """A chunk after a cached prefix: masked SDPA over its gathered blocks."""
    n = chunk.row_end - chunk.row_start
    kv_heads, dim = cache.shape.num_kv_heads, cache.shape.head_dim
    # [n, heads, dim] -> [1, kv_heads, group * n, dim] with rows ordered (head-in-group, token).
    rows = q[chunk.row_start : chunk.row_end].view(n, kv_heads, -1, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
    keys, values = cache.gather(layer, chunk.gather_index, 1)  # type: ignore[arg-type]
    if extras is not None and not extras.plain:
        # a row's head is (kv head, head-in-group): its sink repeats over the chunk's n tokens
        sinks = None if extras.sinks is None else extras.sinks.view(1, kv_heads, -1, 1).repeat_interleave(n, dim=2)
        o = matmul_attention(rows, keys, values, chunk.mask, extras, sinks)  # type: ignore[arg-type]
    else:
        o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=chunk.mask,
                                           scale=None if extras is None else extras.scale)
    # [1, kv_heads, group * n, dim] -> [n, heads * dim]
    out[chunk.row_start : chunk.row_end] = o.view(kv_heads, -1, n, dim).permute(2, 0, 1, 3).reshape(n, -1)


def _flash_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, fb: FlashBatch) -> torch.Tensor:
    k_pool, v_pool = cache.layer_views(layer)
    # causal=True aligns the mask bottom-right, so a chunk's queries see its cached prefix.
    o = flash_attn_varlen_func(
        q, k_pool, v_pool, cu_seqlens_q=fb.cu_seqlens_q, cu_seqlens_k=fb.cu_seqlens_k,
        max_seqlen_q=fb.max_seqlen_q, max_seqlen_k=fb.max_seqlen_k, causal=True, block_table=fb.block_tables,
    )
    return o.reshape(q.shape[0], -1)
