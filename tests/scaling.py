"""A training step's backward and step, with or without a loss scaler (shared by the tests that
compare a scaled loop with a plain one)."""
from __future__ import annotations

from typing import Any

import torch


def backward_and_step(loss: torch.Tensor, optimizer: Any, scaler: Any = None) -> None:
    """``loss.backward(); optimizer.step()``, through ``scaler`` when given (scale, step, update),
    then ``optimizer.zero_grad()``."""
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
