"""The torch backend's ``dtype: auto`` on CPU: bfloat16 only where oneDNN really runs bf16 natively."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from cllm.backends.torch.device import resolve_dtype

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
