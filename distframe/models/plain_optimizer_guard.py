"""A plain torch.optim optimizer stepping the parameters of a model whose strategy needs its own
optimizer is refused at ``step()``.

[Note: plain optimizers over sharded models] FSDP2's users build ``AdamW(model.parameters())``
after wrapping (its parameters are DTensors and carry their sharded gradients). Here ZeRO-1/2/3,
FSDP and a hybrid model over ZeRO keep the reduced gradients in flat shards that only their own
optimizer (``model.optimizer_name``) steps: a plain optimizer over ``model.parameters()`` found
``.grad`` None (ZeRO-2/3, FSDP: nothing trained) or each rank's own un-averaged gradient (ZeRO-1:
the replicas drifted apart), without a word. ``guard(model)`` adds the model to a weak set, and
one global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed
once) raises ConfigError, before anything moves, when an optimizer's param groups start with a
parameter of a live guarded model that ``accepts_plain_optimizer`` is False for, other than its
flat shards (which its own optimizer steps). Cost per step of any optimizer in the process: one
set lookup per param group and guarded model.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distframe.errors import ConfigError

_guarded: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_lock = threading.Lock()


def guard(model: Any) -> None:
    """Refuse plain optimizers over ``model``'s parameters from now on (see the note)."""
    global _installed
    with _lock:
        _guarded.add(model)
        if not _installed:
            register_optimizer_step_pre_hook(_refuse_plain_step)
            _installed = True


def _guarded_ids(model: Any) -> set[int]:
    """Ids of ``model``'s parameters other than its flat shards (cached on the model: parameters
    are fixed once a strategy has wrapped them)."""
    ids = model.__dict__.get("_plain_guard_ids")
    if ids is None:
        try:
            shards = {id(p) for p in model.local_parameter_shard()}
        except AttributeError:  # still being built on another thread (an in-memory rank)
            return set()
        ids = {id(p) for p in model.parameters()} - shards
        model.__dict__["_plain_guard_ids"] = ids
    return ids


def _refuse_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    firsts = [id(group["params"][0]) for group in optimizer.param_groups if group["params"]]
    with _lock:  # a rank thread may be adding one
        models = list(_guarded)
    for model in models:
        if model.accepts_plain_optimizer:
            continue
        ids = _guarded_ids(model)
        if any(first in ids for first in firsts):
            name = model.optimizer_name
            raise ConfigError(
                f"a plain torch.optim.{type(optimizer).__name__} over a {type(model).__name__}'s "
                f"model.parameters() never sees the reduced gradients, which live in the model's flat "
                f"shards; build {name}(model, torch.optim.{type(optimizer).__name__}, **kwargs) instead "
                "(it takes a class or an instance)")
