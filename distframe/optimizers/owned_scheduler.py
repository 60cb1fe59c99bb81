"""The learning-rate scheduler an optimizer owns and steps once per optimizer step
(ElasticOptimizer's ``lr_scheduler=``, AsyncSGDOptimizer's server schedule): building it, refusing
one that cannot be stepped without an argument, its state as JSON, and the param-group settings
that building one overwrites.

[Note: a scheduler built after the state it continues] An owned scheduler is built on groups
that already hold a restored state (a commit, a checkpoint). Building it writes the settings of
its first step into the groups: ``lr`` always, and OneCycleLR and CyclicLR (``cycle_momentum``)
``momentum`` or ``betas`` too; ``load_state_dict`` then restores the scheduler's counters but
writes nothing back into the groups. So the restored groups' settings, every key but ``params``,
are taken before building and put back after loading (``group_settings`` and
``restore_group_settings``); putting back the lr alone left the momentum of the first step.
"""
from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable
from typing import Any

from distframe.errors import ConfigError

__all__ = ["build_scheduler", "group_settings", "restore_group_settings", "scheduler_state"]

# Parameters a call must fill when they have no default (``*args``, ``**kwargs`` need nothing).
_NAMED_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY)


def build_scheduler(builder: Callable[[Any], Any], optimizer: Any, owner: str,
                    instead: str | None = None) -> Any:
    """``builder(optimizer)``; ConfigError when what it built cannot be stepped as ``step()``
    (ReduceLROnPlateau's ``step(metrics)``): the owner steps it with no argument after every
    optimizer step, where torch's TypeError would fail every rank mid-run (``instead``: a fix to
    name for such a scheduler besides a step-based one); ConfigError too when it was built on an
    optimizer other than ``optimizer``."""
    scheduler = builder(optimizer)
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ConfigError(f"{owner} lr_scheduler built {type(scheduler).__name__}, which has no "
                          "step(); return a torch lr scheduler, such as LambdaLR(opt, f)")
    # One built on another optimizer (the torch optimizer from before wrapping) would set that
    # one's rates, never these: refused, unless it holds these very groups (a wrapper and the
    # optimizer it wraps). Without an ``optimizer`` attribute there is nothing to check.
    built_on = getattr(scheduler, "optimizer", optimizer)
    if built_on is not optimizer and getattr(built_on, "param_groups", None) is not optimizer.param_groups:
        raise ConfigError(f"{owner} lr_scheduler built {type(scheduler).__name__} on another optimizer "
                          f"({type(built_on).__name__}), whose rates {owner} never uses; build it on the "
                          "optimizer passed to the builder: lambda opt: LambdaLR(opt, f)")
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let its first step tell
        return scheduler
    # By signature, not class: a user's scheduler whose step needs a value fails the same way.
    needed = [p.name for p in parameters if p.kind in _NAMED_KINDS and p.default is p.empty]
    if needed:
        raise ConfigError(
            f"{owner} lr_scheduler: {type(scheduler).__name__}.step() needs {needed[0]!r} (a "
            f"metric), and {owner} steps its scheduler with no argument after every optimizer "
            f"step; {instead + ', or ' if instead else ''}use a step-based scheduler (LambdaLR, OneCycleLR, "
            "CosineAnnealingLR)")
    return scheduler


def scheduler_state(scheduler: Any, owner: str) -> dict[str, Any]:
    """The scheduler's ``state_dict()`` as plain JSON (commits and checkpoint metadata hold it),
    or ConfigError naming the scheduler whose state is not."""
    try:
        return json.loads(json.dumps(scheduler.state_dict()))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{owner} saves the lr_scheduler's state_dict as JSON, and "
                          f"{type(scheduler).__name__}'s is not ({exc}); use a scheduler "
                          "whose state is plain numbers and lists") from None


def group_settings(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every setting of every group (all keys but ``params``), as they are now: copies, since a
    scheduler may write into a value in place (a tensor lr, a list of betas)."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in param_groups]


def restore_group_settings(param_groups: list[dict[str, Any]], settings: list[dict[str, Any]]) -> None:
    """Puts back what ``group_settings`` took ([Note: a scheduler built after the state it
    continues]); keys it did not hold (ones the scheduler added) stay."""
    for group, saved in zip(param_groups, settings, strict=True):
        group.update(saved)
