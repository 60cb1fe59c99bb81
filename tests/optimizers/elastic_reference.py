"""The uninterrupted run the elastic tests compare with: single-process Adam over global batches."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn


def adam_reference(model: nn.Module, lr: float, batches: Iterable[int],
                   batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A copy of ``model`` after Adam(lr) steps on the MSE loss of ``batch(b)`` for each ``b``."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for b in batches:
        x, y = batch(b)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()
