"""The torch backend's ``dtype: auto`` on CPU: bfloat16 only where oneDNN really runs bf16 natively; float16
linear weights (``linear_weights: auto``) only under auto float32 on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cllm.backends.torch.device import resolve_dtype, resolve_fp16_weights
from cllm.backends.torch.linear import Linear, fp16_linear_works

CPU = torch.device("cpu")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_auto_is_bfloat16_exactly_on_cpus_with_bf16_dot_products() -> None:
    native = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)


def test_auto_is_float32_when_onednn_is_capped_at_avx2() -> None:
    """A CPU flag is not enough: with oneDNN capped below bf16 (as on an AVX2-only machine, or an
    emulation of one), bf16 linears would take a slow path, so auto falls back to float32."""
    code = "import torch; from cllm.backends.torch.device import resolve_dtype; print(resolve_dtype('auto', torch.device('cpu')))"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "torch.float32", out.stderr


def test_explicit_dtypes_are_kept() -> None:
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert resolve_dtype(name, CPU) == dtype
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


# ---- linear_weights: float16 weights under float32 compute (fbgemm's fp16 GEMM) ----------------------

def test_auto_linear_weights_are_float16_only_under_auto_float32_on_cpu() -> None:
    auto_dtype = resolve_dtype("auto", CPU)
    want = auto_dtype == torch.float32 and fp16_linear_works()
    assert resolve_fp16_weights("auto", "auto", auto_dtype, CPU, compiled=False) is want
    # An explicit float32 is the exact float32 model; bf16 and compiled forwards keep their own weights.
    assert resolve_fp16_weights("auto", "float32", torch.float32, CPU, compiled=False) is False
    assert resolve_fp16_weights("auto", "auto", torch.bfloat16, CPU, compiled=False) is False
    assert resolve_fp16_weights("auto", "auto", torch.float32, CPU, compiled=True) is False
    assert resolve_fp16_weights("dtype", "auto", torch.float32, CPU, compiled=False) is False


def test_explicit_float16_weights_are_refused_where_they_cannot_run() -> None:
    for dtype, compiled in ((torch.bfloat16, False), (torch.float32, True)):
        with pytest.raises(ValueError, match="linear_weights=float16"):
            resolve_fp16_weights("float16", "auto", dtype, CPU, compiled=compiled)
    with pytest.raises(ValueError, match="linear_weights=float16"):
        resolve_fp16_weights("float16", "auto", torch.bfloat16, torch.device("cuda"), compiled=False)


def test_float16_weights_compute_float32_on_the_float16_rounded_weights() -> None:
    """What is guaranteed: the product of float32 activations with each weight rounded to float16,
    accumulated in float32, whatever the row count (fbgemm's blocking differs by row count, so a row
    alone and in a batch agree to float32 rounding, not bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 96, generator=gen) * 0.05, torch.randn(200, generator=gen)
    x = torch.randn(16, 96, generator=gen)
    layer = Linear(weight, bias, prepack=True, fp16_weights=True)
    assert layer.weight is None and layer.packed is None  # only the fp16 copy is kept
    got = layer(x)
    want = F.linear(x.double(), weight.half().double(), bias.double()).float()
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got - F.linear(x, weight, bias)).abs().max() > 0  # it is not the float32 weight
    for start, stop in ((0, 1), (3, 4), (0, 5), (7, 16)):
        assert (layer(x[start:stop]) - want[start:stop]).abs().max() < 1e-5 * want.abs().max()
