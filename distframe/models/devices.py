"""Where a wrapped model's tensors live, so the buffers a strategy makes for it (flat spaces,
gradient buckets, received activations) go to the same device: a CUDA model's on its GPU."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


def module_device(*modules: nn.Module) -> torch.device:
    """The device of the first parameter (else buffer) of ``modules``; CPU when they hold none."""
    for module in modules:
        for tensor in module.parameters():
            return tensor.device
        for tensor in module.buffers():
            return tensor.device
    return torch.device("cpu")


def accelerator_of(module: nn.Module) -> torch.device | None:
    """The device a wrapped model's forward inputs are moved to (``inputs_on``): the model's own
    where it lives on an accelerator; None for a CPU model, whose inputs are left where they are
    (torch DDP without ``device_ids`` leaves them too)."""
    device = module_device(module)
    return None if device.type in ("cpu", "meta") else device


def inputs_on(device: torch.device | None, tree: Any) -> Any:
    """``tree`` (a tensor, or lists, tuples, dicts of them) with each CPU tensor in it moved to
    ``device``, as torch DDP (with ``device_ids``) and FSDP2 move a GPU model's forward inputs:
    a batch left on the host ran into torch's "Expected all tensors to be on the same device"
    in the model's first layer. Unchanged when ``device`` is None."""
    if device is None:
        return tree
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True) if t.is_cpu else t, tree)
