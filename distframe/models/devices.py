"""Where a wrapped model's tensors live, so the buffers a strategy makes for it (flat spaces,
gradient buckets, received activations) go to the same device: a CUDA model's on its GPU."""
from __future__ import annotations

import torch
from torch import nn


def module_device(*modules: nn.Module) -> torch.device:
    """The device of the first parameter (else buffer) of ``modules``; CPU when they hold none."""
    for module in modules:
        for tensor in module.parameters():
            return tensor.device
        for tensor in module.buffers():
            return tensor.device
    return torch.device("cpu")
