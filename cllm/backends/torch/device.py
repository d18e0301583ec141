"""Device and dtype from config: CUDA in bfloat16 when present, else CPU."""
from __future__ import annotations

import torch

from cllm.backends.torch.linear import packing_works

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
    less top-1 agreement with llama.cpp (notes/torch.md).
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
