"""Telling a compilation failure from any other error.

torch.compile (dynamo, inductor, triton autotuning) can fail at run time for one
shape it has not seen — e.g. ``InductorError: LoweringException: NoValidChoicesError``
for a FlexAttention prefill shape on an H200. Such a failure says nothing about the
request: the same math runs uncompiled. The torch backend catches these and falls
back (cllm/backends/torch/backend.py); every other error still fails the step.
"""
from __future__ import annotations

COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "triton")


def is_compile_error(err: BaseException) -> bool:
    """Whether ``err``, or an exception it was raised from, comes from torch's compiler stack."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(type(current).__module__.startswith(m) for m in COMPILER_MODULES):
            return True
        current = current.__cause__ or current.__context__
    return False
