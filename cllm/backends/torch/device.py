"""Device and dtype from config: CUDA in bfloat16 when present, else CPU."""
from __future__ import annotations

import os

import torch

from cllm.backends.torch.linear import fp16_linear_works, packing_works
from cllm.backends.torch.loader import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available; an explicit CUDA device that is missing is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"torch device {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torch device {name!r} requested but CUDA is not available; use device=cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"torch device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on CPUs with native bf16 matmul, float32 on other CPUs.

    On a CPU with AVX512-BF16 / AMX, bf16 weights halve the bytes each decode
    step streams and use the bf16 dot-product units: measured 1.6x (1 sequence)
    and 1.4x (16) faster decode than float32 end to end, for about 2 points
    less top-1 agreement with llama.cpp (benchmarks/results/performance_log_torch.md).
    """
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX) and oneDNN uses them.

    The CPU flag alone is not enough: oneDNN may be capped below it (``ONEDNN_MAX_CPU_ISA``, how an
    AVX2-only machine is emulated on a newer one), and then bf16 linears fall back to a slow path.
    So the oneDNN bf16 linear must also pack and agree with ``F.linear`` here (``packing_works``).
    """
    try:
        flagged = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    except AttributeError:  # private probes; an older/newer torch without them gets the safe default
        return False
    return bool(flagged) and packing_works(torch.bfloat16)


def resolve_fp16_weights(setting: str, dtype_setting: str, dtype: torch.dtype, device: torch.device, *, compiled: bool) -> bool:
    """Whether linear weights are kept in float16 under float32 compute (``torch.linear_weights``).

    ``auto`` is float16 exactly when ``dtype: auto`` chose float32 on a CPU (one without native bf16,
    e.g. AVX2-only) and fbgemm's fp16 GEMM runs here: measured 1.5x (16 rows) to 1.7x (one row)
    faster linears there, for a float16 rounding of each weight. An explicit ``dtype: float32``
    keeps float32 weights (bit-for-bit the float32 model), and so does ``torch_compile`` (it traces
    ``F.linear``).
    """
    usable = device.type == "cpu" and dtype == torch.float32 and not compiled
    if setting == "float16":
        if not (usable and fp16_linear_works()):
            raise ValueError(
                f"torch.linear_weights=float16 needs float32 compute on CPU without torch_compile and fbgemm's fp16 "
                f"GEMM (device {device}, dtype {dtype}, torch_compile {compiled}); use linear_weights: dtype"
            )
        return True
    if setting == "auto":
        return usable and dtype_setting == "auto" and fp16_linear_works()
    return False


def resolve_moe_dense(setting: str, spec: ModelSpec, element_bytes: int, device: torch.device) -> bool:
    """Whether sparse layers keep the CPU dense path's second copy of their experts (``torch.moe_dense_decode``):
    ``on`` on a CPU, ``auto`` when that copy (``element_bytes`` a weight) takes at most 1/8 of the host's memory."""
    if setting == "off" or device.type != "cpu" or not spec.num_experts:
        return False
    if setting == "on":
        return True
    sparse_layers = sum(spec.moe_layers)
    copy_bytes = sparse_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size * element_bytes
    return copy_bytes * 8 <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
