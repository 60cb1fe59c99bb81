"""refuse_hooked: a module the strategy replaces must not carry the user's hooks.

[Note: hooks on replaced modules] Tensor parallelism puts split layers in place of the dense
ones (``tensor_parallel_plan``), ``dropout_seed`` replaces dropouts and attention
(``rank_dropout``, ``tensor_parallel_rng``), and context parallelism replaces attention with the
ring (``context_parallel``). A forward or backward hook the user had put on the replaced module
went with it: it never ran again, silently (an activation-patching hook that zeroed an output:
the wrapped model computed what the dense one would not). Carrying it over would hand it this
rank's slice where it saw the whole. So a replaced module holding hooks is a ConfigError naming
it; hooks registered after wrapping, on the module that is there then, run.
"""
from __future__ import annotations

from torch import nn

from distframe.errors import ConfigError

_HOOK_DICTS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
               "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


def refuse_hooked(module: nn.Module, name: str, replaced_by: str) -> None:
    """ConfigError when ``module`` (registered as ``name``), which ``replaced_by`` replaces, holds
    hooks (see [Note: hooks on replaced modules])."""
    kinds = [kind for attr, kind in _HOOK_DICTS.items() if getattr(module, attr, None)]
    if kinds:
        raise ConfigError(
            f"{name or 'the model'} ({type(module).__name__}) has a {' and a '.join(kinds)}, and "
            f"{replaced_by} replaces that module with its own, so the hook would never run again: "
            "remove it before wrapping and register it after wrapping on the module that model.module "
            "holds under that name (for a split layer it sees this rank's part), or on its parent")
