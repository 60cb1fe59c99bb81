"""guard_module_state: the wrapped module's own state_dict() and load_state_dict() under ZeRO-3/FSDP.

[Note: the wrapped module's own state dict] Between uses, a resharded unit's parameters hold NaN
stand-ins ([Note: parameters between uses] in sharded_unit.py). torch DDP's checkpoint idiom,
``torch.save(model.module.state_dict())``, then saved NaN for every one of them without a word, and
``model.module.load_state_dict(sd)`` failed with torch's "more than one element of the
written-to tensor refers to a single memory location". Hooks on the module refuse both while a
parameter holds its stand-in, pointing to what works; inside ``summon_full_parameters()`` the
parameters are whole, and both work as on the plain module. ``copy.deepcopy(model.module)`` (an
EMA copy) was a model of NaN, and the copy kept the hooks that gather the original's units (a
forward of the copy would run them): the module's own ``__deepcopy__``, which deepcopy asks the
instance for first, refuses it, saying how to keep such a copy.
Hooks on the module itself are seen by Python's garbage collector, and they hold no model.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError


def guard_module_state(module: nn.Module, stand_ins: frozenset[int], strategy: str) -> None:
    """Registers the hooks of [Note: the wrapped module's own state dict] on ``module``;
    ``stand_ins``: the data pointers of the stand-ins its resharded parameters hold."""
    if not stand_ins:
        return

    def saved(_module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
        # keep_vars=True hands out the parameters themselves: the model's own reads (its full state
        # dict replaces them with gathered values), where a stand-in is expected.
        held = [name for name, value in state.items() if isinstance(value, torch.Tensor)
                and not isinstance(value, nn.Parameter) and value.data_ptr() in stand_ins]
        if held:
            raise ConfigError(
                f"{strategy}: model.module.state_dict() would hold NaN for '{held[0]}' (and "
                f"{len(held) - 1} more): between uses each unit's parameters are sharded across the "
                "ranks. Save with distframe.checkpoint.save, or take the full weights with "
                "model.gather_full_parameters() (every rank; collective), or call it inside "
                "`with model.summon_full_parameters():`")

    def loading(_module: nn.Module, *_: Any) -> None:
        if any(p.data_ptr() in stand_ins for p in _module.parameters()):
            raise ConfigError(
                f"{strategy}: model.module.load_state_dict() cannot write parameters that are sharded "
                "between uses; load with model.load_state_dict(state) (the unwrapped model's keys; "
                "every rank) or distframe.checkpoint.load, or inside "
                "`with model.summon_full_parameters():`")

    def deep_copy(_memo: dict[int, Any]) -> nn.Module:
        raise ConfigError(
            f"{strategy}: copy.deepcopy(model.module) would copy NaN for parameters sharded between "
            "uses, and the hooks that gather them, which would run the original model's units from "
            "the copy. Copy the module before wrapping it (ema = copy.deepcopy(module)) and update it "
            "from the model: ema.load_state_dict(model.gather_full_parameters()) (every rank; "
            "collective), or inside `with model.summon_full_parameters():` from model.module.state_dict()")

    module.register_state_dict_post_hook(saved)
    module.register_load_state_dict_pre_hook(loading)
    # copy.deepcopy asks the instance for __deepcopy__ before its class (an EMA copy's idiom).
    module.__dict__["__deepcopy__"] = deep_copy
