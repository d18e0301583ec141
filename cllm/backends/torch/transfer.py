"""Host arrays to the device without waiting for the device."""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``. On CUDA the copy goes through pinned memory, asynchronously: a copy from
    ordinary (pageable) memory makes PyTorch synchronize the stream, so each of a step's small input
    copies waited for every kernel queued before it. That kept the eager part of a split step
    (TorchBackend._forward_split) from being launched while the decode graph replayed (py-spy, 256
    streams on an H100: 6 % of the engine process waiting in these copies). On the CPU: the array
    itself, as a tensor."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
