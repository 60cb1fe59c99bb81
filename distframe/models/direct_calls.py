"""The wrapped module called directly, not through its wrapper.

[Note: the wrapped module called directly]
``model = FSDPModel(net, backend)`` leaves ``net`` callable, and ``net(x)`` runs: the units gather
in its submodules' hooks and backward computes gradients. But ZeRO-1/2/3 and FSDP arm their
gradient reduction in the wrapper's forward, so after ``net(x).backward()`` nothing was reduced,
the optimizer stepped nothing and ``zero_grad`` cleared the gradients: training did nothing, with
no error (or, once the wrapper had run under ``no_sync``, kept its last setting). torch DDP's
reducer is armed in its forward too. So such a model refuses, at the call, a forward of the
wrapped module with grad that does not come through the wrapper, naming the fix. Under
``no_grad`` (an evaluation) a direct call computes what the wrapper's would and is let through;
so are recomputations in backward (activation checkpointing) and calls Dynamo traces.
DDPModel and the model-parallel models synchronise whatever backward produced, so they need none.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.models.unit_order import in_backward


class DirectCalls:
    """``DirectCalls(model)`` refuses direct forwards of ``model.wrapped_model`` with grad (see the
    note); ``DirectCalls()`` refuses nothing. ``calling()`` wraps the wrapper's own call."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.through = False
        self.guarded = model is not None
        if model is not None:
            name = type(model).__name__
            model.wrapped_model.register_forward_pre_hook(lambda module, args: self._check(name),
                                                          prepend=True)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        if not self.guarded:
            yield
            return
        previous, self.through = self.through, True
        try:
            yield
        finally:
            self.through = previous

    def _check(self, name: str) -> Any:
        if self.through or not torch.is_grad_enabled() or in_backward() or torch.compiler.is_compiling():
            return None
        raise ConfigError(
            f"the module wrapped by {name} was called directly (net(x)) with grad enabled, not through "
            f"the {name} (model(x)): {name} arms its gradient reduction in its own forward, so this "
            "backward's gradients would never be reduced and the optimizer would step nothing. Call "
            "the wrapper; a direct call under torch.no_grad() (evaluation) is fine")
