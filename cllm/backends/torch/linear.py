"""A linear layer whose weight sits in the fastest layout for its device.

On CPU, ``F.linear`` hands bf16/fp32 matmuls to oneDNN/MKL, which re-lays the
weight out on every call. Reordering it once into oneDNN's blocked format
(what inductor's freezing pass does) and calling the oneDNN linear directly
measured, per decode step of SmolLM2-135M on one thread (CPU time):
bf16 8.2 -> 4.3 ms at 1 token, 14.6 -> 10.0 ms at 16; fp32 52 -> 20 ms at 16
(benchmarks/results/performance_log_torch.md). The ops are private to torch, so the packed path is probed
once per dtype against ``F.linear``; where it fails, layers keep the plain weight.

A float32 model can instead keep its weights in float16 (``fp16_weights``): fbgemm's
fp16 GEMM widens them to float32 inside its kernel (activations and accumulation stay
float32), reading half the bytes. On an AVX2-only AMD EPYC the 30 layers' linears of
SmolLM2-135M took 38 vs 59 ms at 16 rows and 15 vs 26 ms at one (oneDNN fp32 packed),
with a float16 rounding of each weight (relative 2^-11, 8x finer than bfloat16).

Under ``model.deterministic`` (``pad_rows``) the rows are padded with zeros to a multiple of
``INVARIANT_ROWS``: oneDNN and MKL pick another kernel for a few rows than for many (float32, SmolLM2's
shapes: a row's result differed with 1-3, 5-7 and 9-11 rows from the same row among 600; bfloat16 at
one row), and a kernel's accumulation order is its own. Padded, every call runs the kernel of 8+ rows,
and a row's result was the same at every row count and offset tried (1-140 rows, every path here:
plain, prepacked, fbgemm float16; tests/unit/test_batch_invariant_ops.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 16  # oneDNN picks the blocked layout for this many rows; any row count works
INVARIANT_ROWS = 8  # pad_rows: rows are padded to a multiple of this (at least this many)


def _fp16_ops() -> tuple[object | None, object | None]:
    """fbgemm's fp16 linear and prepack ops, resolved once: calling an op through its overload packet
    costs a schema lookup per call (~10 us; ~1.5 ms a 16-row decode step of SmolLM2's 121 linears).
    (None, None) where the build has no fbgemm (non-x86)."""
    try:
        return torch.ops.quantized.linear_dynamic_fp16.default, torch.ops.quantized.linear_prepack_fp16.default
    except (AttributeError, RuntimeError):
        return None, None


_FP16_LINEAR, _FP16_PREPACK = _fp16_ops()


class Linear:
    """``y = x @ weight.T + bias``; prepacked for oneDNN when asked and it works here."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, prepack: bool, fp16_weights: bool = False,
        pad_rows: bool = False,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.pad_rows = pad_rows  # model.deterministic: the same kernel whatever the row count (module docstring)
        self.weight = weight  # the plain [out, in] weight, unless packed (then None)
        self.packed: torch.Tensor | None = None  # oneDNN-blocked weight
        self.fp16: object | None = None  # fbgemm-packed float16 weight (and bias): a float32 model's fp16_weights
        if fp16_weights:  # resolve_fp16_weights checked that fbgemm runs here and the weight is float32
            self.fp16 = _FP16_PREPACK(weight, bias)
            self.weight = None
        elif prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            self.packed = _try_pack(weight, bias)
            if self.packed is not None:
                self.weight = None  # the packed copy replaces it: no double memory

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_rows:
            return self._padded(x)
        return self._matmul(x)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        padded = max(INVARIANT_ROWS, -(-n // INVARIANT_ROWS) * INVARIANT_ROWS)
        if padded != n:
            rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
        return self._matmul(rows)[:n].reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16 is not None:
            return _FP16_LINEAR(x, self.fp16)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _try_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None if this torch/CPU cannot run packed linears of its dtype."""
    if not packing_works(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


@lru_cache(maxsize=None)
def packing_works(dtype: torch.dtype) -> bool:
    """Whether the packed path runs and agrees with ``F.linear`` here (probed once per dtype)."""
    weight = torch.linspace(-1, 1, 48 * 32).view(48, 32).to(dtype)
    bias = torch.linspace(0, 1, 48).to(dtype)
    probe = torch.linspace(-1, 1, 5 * 32).view(5, 32).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    want = F.linear(probe, weight, bias)
    tolerance = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return bool((got.float() - want.float()).abs().max() < tolerance * want.abs().max().clamp(min=1.0))


@lru_cache(maxsize=None)
def fp16_linear_works() -> bool:
    """Whether fbgemm's fp16-weight GEMM runs here and agrees with ``F.linear`` on float16-exact weights."""
    if _FP16_LINEAR is None or _FP16_PREPACK is None:
        return False
    weight = torch.linspace(-1, 1, 48 * 32).view(48, 32).half().float()
    bias = torch.linspace(0, 1, 48)
    probe = torch.linspace(-1, 1, 5 * 32).view(5, 32)
    try:
        got = _FP16_LINEAR(probe, _FP16_PREPACK(weight, bias))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    want = F.linear(probe, weight, bias)
    return bool((got - want).abs().max() < 1e-4 * want.abs().max().clamp(min=1.0))
