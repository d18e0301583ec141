"""KV pool size from free accelerator memory (``gpu_memory_utilization``, as vLLM).

The pool may take what is left of ``total * gpu_memory_utilization`` once the
weights are loaded, minus room for one step's activations. The arithmetic is
pure (numbers in, numbers out) so it is tested on CPU with injected figures;
:func:`cuda_memory` reads the real ones through ``torch.cuda.mem_get_info``.
Every way it can fail is a ValueError at start-up naming the figures, never a
CUDA out-of-memory error in the middle of serving.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    """What the device reports."""

    free_bytes: int  # free now (after our weights loaded, when measured for sizing)
    total_bytes: int  # device capacity


@dataclass(slots=True, frozen=True)
class KVSizing:
    """The resulting pool."""

    num_blocks: int  # KV blocks per layer
    budget_bytes: int  # bytes the pool may take
    bytes_per_block: int  # K+V bytes of one block across all layers


def cuda_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free_bytes=int(free), total_bytes=int(total))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def activation_bytes(*, max_batch_tokens: int, max_num_seqs: int, hidden: int, intermediate: int, heads: int,
                     head_dim: int, vocab: int, itemsize: int, graph_rows: int = 0) -> int:
    """Upper estimate of what a step allocates besides the weights and the KV pool: the largest layer's
    activations, float32 logits twice (the LM head's output and the sampler's working copy), and the
    captured decode graphs' shared float32 logits buffer (``graph_rows`` rows: the largest bucket).
    The pool is sized before the graphs are captured, so what they keep must be counted here."""
    per_token = hidden * 3 + intermediate * 3 + heads * head_dim * 3  # residual, norm, MLP gate|up + act, qkv
    return max_batch_tokens * per_token * itemsize + (2 * max_num_seqs + graph_rows) * vocab * 4


def check_startup_free(memory: DeviceMemory, utilization: float) -> None:
    """Before loading: the share we are to use must be free (another process may hold the rest)."""
    wanted = memory.total_bytes * utilization
    if memory.free_bytes < wanted:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {wanted / GIB:.2f} GiB of the device's "
            f"{memory.total_bytes / GIB:.2f} GiB, but only {memory.free_bytes / GIB:.2f} GiB is free "
            "(another process holds the rest): lower gpu_memory_utilization or free the device"
        )


def size_kv_pool(memory: DeviceMemory, *, utilization: float, activation_reserve: int, bytes_per_block: int,
                 block_size: int, min_tokens: int) -> KVSizing:
    """Blocks that fit in ``total * utilization`` minus what is already used and the activation reserve.

    ``memory`` is measured after the weights loaded, so ``total - free`` counts them (and anything
    else on the device). ``min_tokens`` (one longest sequence) must fit, else ValueError.
    """
    used = memory.total_bytes - memory.free_bytes
    budget = int(memory.total_bytes * utilization) - used - activation_reserve
    num_blocks = max(budget, 0) // bytes_per_block
    if num_blocks * block_size < min_tokens:
        raise ValueError(
            f"KV cache does not fit: gpu_memory_utilization={utilization} of {memory.total_bytes / GIB:.2f} GiB "
            f"leaves {budget / GIB:.2f} GiB after {used / GIB:.2f} GiB in use (weights and others) and "
            f"{activation_reserve / GIB:.2f} GiB reserved for activations; {min_tokens} tokens "
            f"(one sequence of max_model_len) need {-(-min_tokens // block_size) * bytes_per_block / GIB:.2f} GiB: "
            "raise gpu_memory_utilization, lower n_ctx, or use a smaller model/dtype"
        )
    return KVSizing(num_blocks=num_blocks, budget_bytes=budget, bytes_per_block=bytes_per_block)
