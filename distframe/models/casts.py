"""Casts, device moves and copies of a wrapped model: ``model.half()``, ``.to(device)``,
``copy.deepcopy(model)``, ``pickle.dumps(model)``.

[Note: casts after wrapping]
nn.Module's ``_apply`` (behind ``.to()``, ``.float()``, ``.double()``, ``.half()``, ``.cuda()``) gives
each parameter whose dtype or device changes new storage (``param.data = converted``). DDP and
the model-parallel strategies read their parameters wherever they are, so a round trip
(``model.half()`` for an evaluation, then ``.double()``) trains on exactly. ZeRO-1/2 made the
parameters views of flat buffers at wrapping, and ZeRO-3/FSDP point them at gathered storage
they reuse: the new storage was cut off from it, silently (forward computed with values the
optimizer no longer moved), and after a round trip the per-forward dtype check
(wrapped_parameters.py) saw nothing wrong. So where a plain optimizer does not step the
parameters themselves (``accepts_plain_optimizer`` False), a conversion that would give a
trainable parameter new storage is a ConfigError at the call, found by applying it to each
trainable parameter first (one at a time, dropped at once): nothing is converted, so training goes
on exactly. (Converting, then putting the old storage back, is not the same: a dtype change
through ``param.data`` gives the parameter a new gradient accumulator, and FSDP still drifted.) A conversion that changes nothing (``.double()`` of a float64
model, ``.to("cpu")`` on the CPU) is no change, and one that changes only buffers or frozen
parameters is kept, as the strategies hold neither.
Gap: a conversion of ``model.module`` itself (not the wrapper) is nn.Module's own, unchecked.

[Note: copies of a wrapped model]
A wrapped model holds its communication backend (threads, sockets, locks) and the hooks that
wired the wrapped module's parameters to it; a copy would share or lose them ("cannot pickle
'_thread.lock'"). ``copy.deepcopy``, ``copy.copy`` and pickle (``torch.save(model)``) all ask
``__reduce_ex__``, which raises a ConfigError saying how to copy the weights instead.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distframe.errors import ConfigError


def refuse_new_storage(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """ConfigError when ``fn`` (what nn.Module's ``_apply`` applies) would give a trainable parameter
    of ``model.wrapped_model`` (a ShardedModelBase's) new storage; before anything is converted, so
    the model is left as it was (see [Note: casts after wrapping]). A conversion that changes
    nothing returns the parameter itself: no copy is made."""
    with torch.no_grad():
        for name, param in model.wrapped_model.named_parameters():
            if param.requires_grad and not fn(param).is_set_to(param):
                raise ConfigError(
                    f"{type(model).__name__} cannot follow this cast or device move (model.half(), .float(), "
                    f".double(), .to(...)): parameter {name!r} is {param.dtype} on {param.device}, a view of "
                    "storage the strategy laid out at wrapping, and changed after wrapping it would get "
                    "storage of its own, which training no longer updates; nothing was changed: convert the "
                    "model before wrapping it (or move it), or for lower-precision compute keep it as it is "
                    "and use torch.autocast or mixed_precision=MixedPrecisionPolicy(param_dtype=...)")


def copy_refused(model: nn.Module) -> ConfigError:
    """The error for a copy or pickle of a wrapped model (see [Note: copies of a wrapped model])."""
    strategy = type(model).__name__
    return ConfigError(
        f"{strategy} cannot be copied or pickled (copy.deepcopy, copy.copy, pickle, torch.save): it holds "
        "its communication backend and the hooks wired to its parameters. Copy the weights instead: "
        "model.gather_full_parameters() (collective) gives the unwrapped model's state dict, to load "
        "into a copy of the module made before wrapping (copy.deepcopy(module) before wrapping it); "
        "model.state_dict() or distframe.checkpoint save this rank's share")
