"""GPU offload and KV-cache type settings for llama.cpp, resolved against the installed build.

``n_gpu_layers`` left unset means "all layers when this llama-cpp-python was
built with a GPU backend (CUDA, Metal, Vulkan, ...), else none": the same
config then serves a CPU wheel and a CUDA build without edits. llama.cpp
clamps the layer count to the model's, so "all" is simply a very large count
(llama-cpp-python's own ``n_gpu_layers=-1`` does the same).
"""
from __future__ import annotations

from collections.abc import Callable

import llama_cpp as C

ALL_LAYERS = 0x7FFFFFFF  # more layers than any model has: llama.cpp offloads them all

# KV cache element types llama.cpp accepts (llama-server's --cache-type-k/-v list) -> ggml_type
# values from ggml.h (stable ABI numbers).
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7,
}
UNQUANTIZED_KV_TYPES = frozenset({"f32", "f16", "bf16"})


def gpu_offload_supported() -> bool:
    """Whether the installed llama.cpp has a GPU backend to offload layers to."""
    return bool(C.llama_supports_gpu_offload())


def resolve_gpu_layers(setting: int | None, supported: Callable[[], bool] = gpu_offload_supported) -> int:
    """Layers to offload: ``None`` = all if the build can offload else 0; ``-1`` = all; else as given."""
    if setting is None:
        return ALL_LAYERS if supported() else 0
    return ALL_LAYERS if setting < 0 else setting


def kv_cache_type(name: str) -> int:
    """ggml_type of a KV cache type name; ValueError naming the valid names."""
    try:
        return KV_CACHE_TYPES[name]
    except KeyError:
        raise ValueError(f"KV cache type {name!r} is not supported; use one of {', '.join(KV_CACHE_TYPES)}") from None
