"""KV pool sizing from device memory (gpu_memory_utilization), with injected figures."""
from __future__ import annotations

import pytest
import torch

from cllm.backends.torch.memory import (
    GIB, DeviceMemory, activation_bytes, check_startup_free, kv_bytes_per_token, size_kv_pool,
)
from cllm.config import load_config


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 -> 128 KiB per token.
    assert kv_bytes_per_token(32, 8, 128, torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_pool_takes_what_the_utilization_share_leaves_after_weights_and_activations():
    # 80 GiB device, 16 GiB in use after loading weights, 2 GiB activation reserve, 90 %.
    mem = DeviceMemory(free_bytes=64 * GIB, total_bytes=80 * GIB)
    per_block = 16 * 131072  # 16 tokens of Llama-3-8B KV = 2 MiB
    sizing = size_kv_pool(mem, utilization=0.9, activation_reserve=2 * GIB, bytes_per_block=per_block,
                          block_size=16, min_tokens=8192)
    budget = int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB
    assert sizing.budget_bytes == budget
    assert sizing.num_blocks == budget // per_block == 27648  # 54 GiB of 2 MiB blocks: 442,368 tokens of KV
    assert sizing.num_blocks * per_block <= budget < (sizing.num_blocks + 1) * per_block


def test_lower_utilization_gives_a_smaller_pool():
    mem = DeviceMemory(free_bytes=70 * GIB, total_bytes=80 * GIB)
    sizes = [size_kv_pool(mem, utilization=u, activation_reserve=GIB, bytes_per_block=1 << 20, block_size=16,
                          min_tokens=16).num_blocks for u in (0.5, 0.7, 0.9)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert abs((sizes[2] - sizes[1]) - 16384) <= 1  # 0.2 of 80 GiB = 16 GiB = 16384 blocks of 1 MiB


def test_too_little_memory_is_a_value_error_naming_the_numbers():
    # 24 GiB card with 16 GiB of weights at 0.7: 16.8 - 16 - 1 < 0 -> nothing left for KV.
    mem = DeviceMemory(free_bytes=8 * GIB, total_bytes=24 * GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.7 of 24\.00 GiB.*16\.00 GiB in use.*8192 tokens"):
        size_kv_pool(mem, utilization=0.7, activation_reserve=GIB, bytes_per_block=2 << 20, block_size=16,
                     min_tokens=8192)


def test_pool_smaller_than_one_longest_sequence_is_refused():
    mem = DeviceMemory(free_bytes=20 * GIB, total_bytes=24 * GIB)  # 21.6 - 4 - 1 = 16.6 GiB of KV
    per_block = 16 * 131072
    ok = size_kv_pool(mem, utilization=0.9, activation_reserve=GIB, bytes_per_block=per_block, block_size=16,
                      min_tokens=131072)  # 128k context = 16 GiB: fits
    assert ok.num_blocks * 16 >= 131072
    with pytest.raises(ValueError, match="262144 tokens"):
        size_kv_pool(mem, utilization=0.9, activation_reserve=GIB, bytes_per_block=per_block, block_size=16,
                     min_tokens=262144)


def test_startup_check_refuses_a_share_another_process_holds():
    check_startup_free(DeviceMemory(free_bytes=79 * GIB, total_bytes=80 * GIB), 0.9)
    with pytest.raises(ValueError, match=r"72\.00 GiB of the device's 80\.00 GiB, but only 40\.00 GiB is free"):
        check_startup_free(DeviceMemory(free_bytes=40 * GIB, total_bytes=80 * GIB), 0.9)


def test_activation_reserve_grows_with_the_step():
    small = activation_bytes(max_batch_tokens=512, max_num_seqs=8, hidden=576, intermediate=1536, heads=9,
                             head_dim=64, vocab=49152, itemsize=2)
    big = activation_bytes(max_batch_tokens=8192, max_num_seqs=256, hidden=576, intermediate=1536, heads=9,
                           head_dim=64, vocab=49152, itemsize=2)
    assert 0 < small < big
    assert big >= 2 * 256 * 49152 * 4  # float32 logits of every sequence, twice


@pytest.mark.parametrize("kwargs, text", [
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_n_seq_max": 0}, "gpu_n_seq_max"), ({"gpu_n_batch": -1}, "gpu_n_batch"),
])
def test_gpu_settings_are_validated(kwargs, text):
    with pytest.raises(ValueError, match=text):
        load_config(None, environ={}, **kwargs)


def test_gpu_defaults():
    cfg = load_config(None, environ={})
    assert (cfg.torch.gpu_memory_utilization, cfg.torch.gpu_n_seq_max, cfg.torch.gpu_n_batch) == (0.9, 256, 8192)


def test_gpu_step_limits_and_attention_choice_by_device():
    from cllm.backends.torch.attention import attention_mode
    from cllm.backends.torch.backend import CPU_N_SEQ_MAX, _step_limits

    cfg = load_config(None, environ={})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cpu_limits = (CPU_N_SEQ_MAX, cfg.model.n_batch)  # n_seq_max unset: the CPU-sized default
    assert _step_limits(cfg, cuda) == (256, 8192) and _step_limits(cfg, cpu) == cpu_limits
    assert _step_limits(cfg.with_overrides(gpu_n_seq_max=None, gpu_n_batch=None), cuda) == cpu_limits
    assert attention_mode("auto", cpu, 16) == "sdpa"
    assert attention_mode("auto", cuda, 16) == "flex"  # flash-attn needs block_size % 256 == 0 (and the package)
    assert attention_mode("flex", cpu, 16) == "flex"
    with pytest.raises(ValueError, match="attention='flash'"):
        attention_mode("flash", cpu, 256)
