"""BackwardEnd: run a strategy's gradient finish as the last act of the user's backward pass.

torch DDP's reducer queues its finish on autograd's execution engine from the first gradient
hook of a backward; so do DDP, ZeRO-1/2 (``GradientBuckets``) and ZeRO-3/FSDP (``UnitLifecycle``)
here, through this one piece. ``watch(output)`` hooks the tensors of a forward's output: their
gradient is the first one a backward through them computes, so the finish lands on the user's
backward, not on one nested inside it (reentrant activation checkpointing runs a backward of its
own, which may reach parameters first). ``queue()`` from a parameter hook covers a loss that
bypasses the watched outputs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class BackwardEnd:
    """Calls ``finish()`` once at the end of each backward pass that ``queue`` was called in."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish = finish
        self._queued = False

    def watch(self, output: Any, hook: Callable[..., Any] | None = None) -> None:
        """Registers ``hook`` (default: ``queue``) on every tensor of ``output`` requiring grad."""
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook or self.queue)

    def queue(self, *_: Any) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def reset(self) -> None:
        """Forgets a queued finish whose backward raised before running it."""
        self._queued = False

    def _run(self) -> None:
        self._queued = False
        self._finish()
