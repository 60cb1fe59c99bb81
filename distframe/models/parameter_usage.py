"""Which parameters hold a gradient, on this rank and (with ``find_unused_parameters``) on any.

Single-process training leaves ``.grad`` None for a parameter that took no part in producing the
loss since gradients were last cleared, and torch.optim skips it: no weight decay, no momentum,
no step count. A data-parallel model whose gradients are views into flat bucket buffers reduces
such a parameter's slot as zeros, so the optimizer would move it anyway. With
``find_unused_parameters=True`` (torch DDP's name and meaning) each synchronisation also reduces
one flag per parameter (one small ``all_reduce(MAX)``, started behind the last bucket) and a
parameter that no rank gave a gradient gets ``.grad = None`` again, as single-process training
has it. Without it, a rank that sees a parameter without a gradient at synchronisation warns once.

A parameter "holds a gradient" from its first gradient hook until its ``.grad`` is cleared
(``zero_grad`` sets it to None): gradients accumulated under ``no_sync`` or across steps without
``zero_grad`` count, as they do for a plain model.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp, Work


class ParameterUsage:
    """``names[i]``/``params[i]``: the parameters in bucket order. ``fix``: what the warning
    tells the user to do (None: ``find_unused_parameters`` is on and no warning is needed)."""

    def __init__(self, names: list[str], params: list[nn.Parameter], backend: ICommunicationBackend,
                 *, find_unused: bool, owner: str, fix: str) -> None:
        self.names = names
        self.params = params
        self.backend = backend
        self.find_unused = find_unused
        self.owner = owner
        self.fix = fix
        self.has_gradient = [False] * len(params)
        self._warned = False

    def start(self) -> tuple[Work, torch.Tensor] | None:
        """Launches the flags' all_reduce (after the buckets', so every rank issues it in the
        same place); None when ``find_unused`` is off."""
        if not self.find_unused:
            return None
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor(self.has_gradient, dtype=torch.uint8, device=device)
        return self.backend.all_reduce(flags, ReduceOp.MAX, async_op=True), flags

    def warn_unless_every_gradient_is_held(self) -> None:
        """For a strategy without gradient hooks: reads which parameters hold a ``.grad`` now,
        and warns once as ``finish`` does."""
        self.has_gradient = [p.grad is not None for p in self.params]
        self.finish(None)

    def finish(self, started: tuple[Work, torch.Tensor] | None) -> None:
        """After the buckets completed: clears ``.grad`` of parameters no rank gave a gradient
        (``find_unused``), else warns once if this rank has any."""
        if started is not None:
            work, flags = started
            work.wait()
            for i, flag in enumerate(flags.tolist()):
                if not flag:
                    self.params[i].grad = None
            return
        if self._warned or all(self.has_gradient):
            return
        self._warned = True
        missing = [n for n, has in zip(self.names, self.has_gradient) if not has]
        shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
        warnings.warn(
            f"{self.owner}: {len(missing)} parameter(s) got no gradient on rank {self.backend.rank} "
            f"({shown}). If no rank gives them one, they are averaged as zeros, and an optimizer "
            f"with weight decay or momentum still moves them where single-process training would "
            f"skip them. {self.fix}", stacklevel=2)
