"""The CUDA decode path's pieces that CPU can check (cllm/backends/torch/flex.py, cuda_graphs.py).

On CUDA a decode group's FlexAttention mask lists every block of a sequence as partial and, to keep
its tensors small at large batches, has no physical -> logical lookup: its mask_mod is exact only on
the sequence's own blocks, the only ones a compiled kernel evaluates it on. Here it is compared with
the exact (lookup) mask on exactly those slots. The kernels themselves run only on a GPU
(benchmarks/gpu_decode.py checks their logits against transformers there).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cllm.backends.torch.attention import attention_mode
from cllm.backends.torch.cuda_graphs import StagedInputs
from cllm.backends.torch.flex import PagedMaskTensors, decode_mask_arrays, paged_block_mask
from cllm.backends.torch.kv_cache import KVCacheShape, PagedKVCache

BS = 4


def _mask(arrays: dict[str, np.ndarray], cache: PagedKVCache):
    tensors = PagedMaskTensors(**{name: torch.from_numpy(a) for name, a in arrays.items()})
    return paged_block_mask(tensors, 3, cache, causal=False), tensors


def test_the_listed_decode_mask_equals_the_exact_one_on_every_listed_slot():
    cache = PagedKVCache(KVCacheShape(1, 40, BS, 1, 4, max_seq_blocks=10), dtype=torch.float32,
                         device=torch.device("cpu"), head_major=True)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(40)
    lens = [1, 4, 5, 17, 40, 9]  # a fresh block, exactly full blocks, partial last blocks, the longest
    tables, start = [], 0
    for n in lens:
        k = -(-n // BS)
        tables.append(tuple(int(b) for b in blocks[start : start + k]))
        start += k
    exact, _ = _mask(decode_mask_arrays(lens, tables, cache, lookup=True), cache)
    listed, t = _mask(decode_mask_arrays(lens, tables, cache, lookup=False), cache)
    assert t.block_of is None and t.full_num is None and t.part_idx.shape[-1] == 40  # CPU: width = pool
    for b, (n, table) in enumerate(zip(lens, tables)):
        assert t.part_num[b].item() == len(table) and t.last_block[b].item() == table[-1]
        kv = torch.tensor([blk * BS + off for blk in table for off in range(BS)])
        bb = torch.full_like(kv, b)
        for q in range(3):  # the q axis holds one token's query heads: the same answer for each
            qq = torch.full_like(kv, q)
            want = exact.mask_mod(bb, torch.zeros_like(kv), qq, kv)
            assert want.sum().item() == n  # the exact mask shows the sequence's n tokens, no more
            assert torch.equal(listed.mask_mod(bb, torch.zeros_like(kv), qq, kv), want)


def test_a_causal_mask_needs_the_lookup():
    cache = PagedKVCache(KVCacheShape(1, 8, BS, 1, 4), dtype=torch.float32, device=torch.device("cpu"), head_major=True)
    t = PagedMaskTensors(**{n: torch.from_numpy(a) for n, a in decode_mask_arrays([3], [(2,)], cache, lookup=False).items()})
    with pytest.raises(ValueError, match="lookup"):
        paged_block_mask(t, 1, cache, causal=True)


def test_staged_inputs_refill_every_view_from_one_buffer_per_dtype():
    first = {"ids": np.array([1, 2, 3]), "num": np.array([[4], [5], [6]], dtype=np.int32), "pos": np.array([7, 8, 9])}
    staged = StagedInputs(first, torch.device("cpu"))
    assert len(staged._pairs) == 2  # int32 and int64
    for name, array in first.items():
        assert staged.device[name].dtype == torch.from_numpy(array).dtype
        np.testing.assert_array_equal(staged.device[name].numpy(), array)
    views = dict(staged.device)
    second = {"ids": np.array([10, 20, 30]), "num": np.array([[40], [50], [60]], dtype=np.int32), "pos": np.array([0, 0, 1])}
    staged.fill(second)
    for name, array in second.items():
        assert staged.device[name] is views[name]  # same storage: a captured graph reads the new values
        np.testing.assert_array_equal(views[name].numpy(), array)


@pytest.mark.parametrize("block_size", [8, 24, 48])
def test_flex_on_cuda_refuses_a_page_it_cannot_tile(block_size: int):
    with pytest.raises(ValueError, match=f"block_size {block_size}"):
        attention_mode("flex", torch.device("cuda"), block_size)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_flex_on_cuda_takes_power_of_two_pages(block_size: int):
    assert attention_mode("flex", torch.device("cuda"), block_size) == "flex"
    assert attention_mode("flex", torch.device("cpu"), 24) == "flex"  # eager on CPU: any page
