"""Module extra state in sharded state: what ``get_extra_state()`` returns, which torch's
``state_dict`` holds under ``<module>._extra_state`` and ``load_state_dict`` hands back to
``set_extra_state``.

[Note: extra state]
A sharded model keeps extra state as it keeps a buffer: rank 0's is saved whole, as
``buffer/<module>._extra_state`` (every rank is expected to hold the same, as with buffers), so
``state_dict()``, checkpoints and ``consolidate`` carry it under torch's name, and every load
(merged pieces, the full state dict, a checkpoint) calls each module's ``set_extra_state`` with
it. Its shape is not checked (torch does not check it either); its presence is, as a buffer's.
Only a tensor can be stored (safetensors, no pickle): other extra state is a ConfigError when
the model's state is taken, rather than written into metadata.json, where JSON would hand
``set_extra_state`` something other than what ``get_extra_state`` returned (tuples as lists,
integer keys as strings, tensors not at all) and only from the checkpoint path. Pure
bookkeeping; no communication.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from distframe.errors import ConfigError

if TYPE_CHECKING:  # sharded_state imports this module
    from distframe.models.sharded_state import RangeReader

EXTRA_STATE_KEY = "_extra_state"  # torch's own suffix (nn.modules.module._EXTRA_STATE_KEY_SUFFIX)


def extra_state_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state-dict name, module) of every submodule of ``module`` that has extra state (its class
    overrides ``get_extra_state``), named as torch's ``state_dict`` names them: a module held
    twice under each of its names."""
    return [(f"{prefix}.{EXTRA_STATE_KEY}" if prefix else EXTRA_STATE_KEY, sub)
            for prefix, sub in module.named_modules(remove_duplicate=False)
            if type(sub).get_extra_state is not nn.Module.get_extra_state]


def is_extra_state(name: str) -> bool:
    return name == EXTRA_STATE_KEY or name.endswith(f".{EXTRA_STATE_KEY}")


def extra_state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each module's extra state by its state-dict name; ConfigError for one that is not a
    tensor (see [Note: extra state])."""
    out = []
    for name, sub in extra_state_modules(module):
        state = sub.get_extra_state()
        check_extra_state(name, state, f"{type(sub).__name__}.get_extra_state() returns")
        out.append((name, state))
    return out


def check_extra_state(name: str, state: object, what: str = "the state dict holds") -> None:
    """ConfigError unless extra state ``name`` is a tensor."""
    if not isinstance(state, torch.Tensor):
        raise ConfigError(
            f"extra state {name!r}: {what} a {type(state).__name__}, not a tensor; a sharded model "
            "stores extra state as a tensor (safetensors, no pickle), as it stores buffers: make "
            "get_extra_state() return a tensor (and set_extra_state() take one), or keep that state "
            "outside the model's (a checkpoint's JSON info=)")


def copy_replicated(module: nn.Module, reader: RangeReader,
                    named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies each buffer and frozen parameter of ``named`` (checked by ``check_replicated``) from
    ``reader`` into place, and hands each extra state to its module's
    ``set_extra_state`` (a copy, on the device of the module's own)."""
    setters = dict(extra_state_modules(module))
    with torch.no_grad():
        for name, tensor in named:
            if name in setters and is_extra_state(name):
                setters[name].set_extra_state(reader.buffer(name).to(tensor.device, copy=True))
            else:
                tensor.copy_(reader.replicated(name, tensor.shape))
