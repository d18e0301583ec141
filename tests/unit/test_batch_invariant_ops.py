"""model.deterministic's torch kernels on CPU (cllm/backends/torch/invariant.py, linear.py pad_rows): a row's
result is bitwise the same at every row count, offset and thread count tried, and still the right result."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cllm.backends.torch.attention import AttentionExtras, SeqChunk, build_attention_batch, matmul_attention, paged_attention
from cllm.backends.torch.invariant import elementwise
from cllm.backends.torch.kv_cache import KVCacheShape, PagedKVCache
from cllm.backends.torch.linear import Linear, _FP16_PREPACK


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


LINEARS = [("float32", dict(prepack=False)), ("float32", dict(prepack=True)), ("bfloat16", dict(prepack=True))]
if _FP16_PREPACK is not None:
    LINEARS.append(("float32", dict(prepack=False, fp16_weights=True)))


@pytest.mark.parametrize("dtype,kind", LINEARS)
def test_padded_linear_rows_do_not_depend_on_the_row_count_or_offset(dtype, kind):
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    for out_f, in_f in [(1536, 576), (576, 1536)]:
        weight, bias = torch.randn(out_f, in_f, dtype=dt) / 20, torch.randn(out_f, dtype=dt)
        lin = Linear(weight, bias, pad_rows=True, **kind)
        x = torch.randn(300, in_f, dtype=dt)
        full = lin(x)
        for m in list(range(1, 40)) + [63, 64, 65, 130]:
            for offset in (0, 5, 37):
                assert torch.equal(lin(x[offset:offset + m]), full[offset:offset + m]), (m, offset)
        assert lin(x[:3, None]).shape == (3, 1, out_f)  # leading dimensions kept
        torch.testing.assert_close(full.float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fn", [F.silu, lambda t: F.gelu(t, approximate="tanh"), torch.cos])
def test_elementwise_rows_do_not_depend_on_the_row_count_or_threads(fn):
    torch.manual_seed(1)
    x = torch.randn(300, 1000) * 4  # 1000 columns: not a whole number of vectors
    full = elementwise(fn, x)
    for n in (1, 2, 3):
        with threads(n):
            for m in (1, 2, 3, 7, 33, 299):
                assert torch.equal(elementwise(fn, x[:m]), full[:m]), (n, m)
                assert torch.equal(elementwise(fn, x[5:5 + m]), full[5:5 + m]), (n, m)
    torch.testing.assert_close(full, fn(x), rtol=1e-6, atol=1e-6)  # the same function (last-bit differences aside)


def test_row_wise_kernels_rmsnorm_softmax_log_softmax_are_invariant_as_they_are():
    torch.manual_seed(2)
    x = torch.randn(300, 576)
    w = torch.randn(576)
    for op in (lambda t: F.rms_norm(t, (576,), w, 1e-5), lambda t: t.softmax(-1), lambda t: t.log_softmax(-1)):
        full = op(x)
        for n in (1, 2, 3):
            with threads(n):
                for m in (1, 2, 5, 17, 64):
                    assert torch.equal(op(x[3:3 + m]), full[3:3 + m])


def _cache(num_blocks=64, block_size=16, kv_heads=2, dim=32, seed=3):
    shape = KVCacheShape(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads, head_dim=dim)
    cache = PagedKVCache(shape, dtype=torch.float32, device=torch.device("cpu"), head_major=True)
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def _attend(cache, q, chunks, extras=None, window=None):
    """paged_attention on the invariant path, with the step's new K/V equal to what the cache holds."""
    batch = build_attention_batch(chunks, cache, q_per_kv=q.shape[1] // cache.shape.num_kv_heads, mode="invariant",
                                  windows=(window,) if window else ())
    batch = batch.for_window(window)
    rows = batch.write_rows
    k, v = (t[0].view(-1, cache.shape.head_dim).index_select(0, rows).view(q.shape[0], cache.shape.num_kv_heads, -1)
            for t in (cache.k, cache.v))
    return paged_attention(q, k, v, cache, 0, batch, extras)


def _reference(cache, q_row, table, pos, extras=None, window=None):
    """One query row at ``pos`` over its sequence's keys 0..pos, the plain way (float64)."""
    s = cache.shape
    keys = torch.arange(pos + 1)
    blocks = torch.tensor(table)[keys // s.block_size]
    k = cache.k[0][:, blocks, keys % s.block_size].double()  # [kv_heads, keys, dim]
    v = cache.v[0][:, blocks, keys % s.block_size].double()
    q = q_row.view(s.num_kv_heads, -1, s.head_dim).double()
    mask = torch.ones(1, 1, pos + 1, dtype=torch.bool)
    if window is not None:
        mask &= keys > pos - window
    sinks = None if extras is None or extras.sinks is None else extras.sinks.double().view(s.num_kv_heads, -1, 1)
    return matmul_attention(q, k, v, mask, extras, sinks).reshape(-1)


@pytest.mark.parametrize("extras,window", [(None, None), (None, 100),
                                           (AttentionExtras(scale=0.3, softcap=5.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])), None)])
def test_invariant_attention_gives_a_row_the_same_result_in_any_step(extras, window):
    cache = _cache()
    torch.manual_seed(4)
    tables = [list(range(0, 40)), list(range(40, 64)) + [0] * 16]  # two sequences' block tables (16-token blocks)
    q = torch.randn(700, 4, 32)  # 4 heads over 2 KV heads; rows picked by position below
    target_pos = 300  # the row under test: sequence 0's token at position 300
    alone = _attend(cache, q[target_pos:target_pos + 1], [SeqChunk(0, 1, target_pos, tables[0])], extras, window)[0]
    # beside a sequence with a longer context (more key tiles), then as the last row of a prefill chunk
    beside = _attend(cache, torch.cat([q[600:601], q[target_pos:target_pos + 1]]),
                     [SeqChunk(0, 1, 600, tables[0]), SeqChunk(1, 1, target_pos, tables[0])], extras, window)[1]
    chunks = [_attend(cache, q[target_pos - n + 1:target_pos + 1], [SeqChunk(0, n, target_pos - n + 1, tables[0])],
                      extras, window)[-1] for n in (2, 3, 6, 17, 100, 128, 129, 300)]
    with threads(3):
        other_threads = _attend(cache, q[target_pos:target_pos + 1], [SeqChunk(0, 1, target_pos, tables[0])],
                                extras, window)[0]
    assert torch.equal(alone, beside) and torch.equal(alone, other_threads)
    assert all(torch.equal(alone, last) for last in chunks)
    expected = _reference(cache, q[target_pos], tables[0], target_pos, extras, window)
    np.testing.assert_allclose(alone.double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
