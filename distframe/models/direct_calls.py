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

DDPModel (``DirectCalls(model, arms=True)``) instead treats such a call as its own: the hooks run
the wrapper's ``_pre_forward`` (arming the buckets under the current ``no_sync`` setting) and
``_post_forward`` (watching the output, so the backward from it finishes the average as its last
act), so the rank issues the collectives the wrapper's call would, in the same order, and
``.grad`` holds the average when ``backward()`` returns. Without it each rank stepped its own
gradient and the replicas drifted apart (0.054 off one process after one step). Nothing else of
the wrapper's forward runs (no broadcast of buffers, no move of inputs), so a call on one rank
alone (logging a sample with grad) communicates nothing. A backward that no armed call precedes
(a reentrant checkpoint, compiled code) is reduced at the step ([Note: gradients left local at the
step] in gradient_buckets.py). The model-parallel models synchronise at the step whatever backward
produced, so they need none.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.models.unit_order import in_backward


class DirectCalls:
    """``DirectCalls(model)`` refuses direct forwards of ``model.wrapped_model`` with grad (see the
    note), ``DirectCalls(model, arms=True)`` runs the wrapper's pre- and post-forward around them;
    ``DirectCalls()`` does neither. ``calling()`` wraps the wrapper's own call."""

    def __init__(self, model: nn.Module | None = None, *, arms: bool = False) -> None:
        self.through = False
        self.guarded = model is not None
        if model is None:
            return
        name, module = type(model).__name__, model.wrapped_model
        if not arms:
            module.register_forward_pre_hook(lambda module, args: self._check(name), prepend=True)
            return
        owner = weakref.ref(model)  # the module's hooks must not keep its wrapper alive
        module.register_forward_pre_hook(lambda module, args: self._arm(owner), prepend=True)
        module.register_forward_hook(lambda module, args, output: self._watch(owner, output))

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

    def _direct(self) -> bool:
        """Whether the call running is a direct one with grad (see the note for what is not)."""
        return not (self.through or not torch.is_grad_enabled() or in_backward()
                    or torch.compiler.is_compiling())

    def _arm(self, owner: weakref.ref) -> None:
        model = owner()
        if model is not None and self._direct():
            model._pre_forward()  # noqa: SLF001 - the wrapper's own step, for a call it did not make

    def _watch(self, owner: weakref.ref, output: Any) -> None:
        model = owner()
        if model is not None and self._direct():
            model._post_forward(output)  # noqa: SLF001

    def _check(self, name: str) -> Any:
        if not self._direct():
            return None
        raise ConfigError(
            f"the module wrapped by {name} was called directly (net(x)) with grad enabled, not through "
            f"the {name} (model(x)): {name} arms its gradient reduction in its own forward, so this "
            "backward's gradients would never be reduced and the optimizer would step nothing. Call "
            "the wrapper; a direct call under torch.no_grad() (evaluation) is fine")
