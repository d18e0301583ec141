"""PyTorch backend: our Llama-family decoder over a paged, prefix-cached KV cache.

Imported lazily through the backend registry (``"torch"``), so llama.cpp users
never import torch.
"""
from __future__ import annotations

from cllm.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
