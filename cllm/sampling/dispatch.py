"""One entry point for both samplers: numpy logits -> the numpy sampler, a torch tensor -> the torch one.

A backend that samples on its device (the torch backend on CUDA, see its
``sampler`` setting) returns logits as a device tensor; they are then masked
(grammar), biased, penalised and sampled there, and only the chosen ids and the
requested logprobs reach the host. torch is imported only when such a tensor
arrives, so the llama.cpp-only install never needs it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cllm.sampling.sampler import SampledToken, SamplingRow, sample


def sample_logits(logits: Any, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of ``logits``: a float32 numpy array or torch tensor ``[B, vocab]``."""
    if isinstance(logits, np.ndarray):
        return sample(logits, rows)
    from cllm.sampling.torch_sampler import sample as sample_on_device

    return sample_on_device(logits, rows)


def stack_rows(rows: Sequence[Any], vocab: int) -> Any:
    """Stack single logits rows (numpy or torch, as the backend returned them) into one batch."""
    if not rows:
        return np.empty((0, vocab), dtype=np.float32)
    if isinstance(rows[0], np.ndarray):
        return np.stack(rows)
    import torch

    return torch.stack(list(rows))
