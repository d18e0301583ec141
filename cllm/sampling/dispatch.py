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


class HostSample:
    """A batch sampled on the host (numpy): ready at once, no device ids."""

    token_ids = None

    def __init__(self, results: list[SampledToken]) -> None:
        self._results = results

    def results(self) -> list[SampledToken]:
        return self._results


def launch_sample(logits: Any, rows: Sequence[SamplingRow]) -> Any:
    """Sample one token per row, returning before the device is waited for: an object with ``token_ids``
    (the chosen ids as a device tensor; None for numpy logits) and ``results()`` (the host values,
    which wait for the device)."""
    if isinstance(logits, np.ndarray):
        return HostSample(sample(logits, rows))
    from cllm.sampling.torch_sampler import sample_on_device

    return sample_on_device(logits, rows)


def sample_logits(logits: Any, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of ``logits``: a float32 numpy array or torch tensor ``[B, vocab]``."""
    if isinstance(logits, np.ndarray):
        return sample(logits, rows)
    from cllm.sampling.torch_sampler import sample as sample_on_device

    return sample_on_device(logits, rows)


def take_rows(parts: Sequence[Any], index: Sequence[int]) -> Any:
    """Rows ``index`` of the parts' rows stacked in order (torch tensors on one device, or numpy arrays)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)[np.asarray(index, dtype=np.int64)]
    import torch

    whole = parts[0] if len(parts) == 1 else torch.cat(list(parts))
    return whole.index_select(0, torch.tensor(index, dtype=torch.int64, device=whole.device))


def stack_rows(rows: Sequence[Any], vocab: int) -> Any:
    """Stack single logits rows (numpy or torch, as the backend returned them) into one batch."""
    if not rows:
        return np.empty((0, vocab), dtype=np.float32)
    if isinstance(rows[0], np.ndarray):
        return np.stack(rows)
    import torch

    return torch.stack(list(rows))
