"""AsyncSGDOptimizer's learning-rate schedule: the server's alone.

A worker pushes only its gradient; the server applies it at the rate of its own param groups.
So a schedule runs where the updates are applied: ``lr_scheduler=`` builds a scheduler on each
rank's wrapped optimizer, and the server steps its own once per applied update (a worker's
never steps: it carries the server's state into checkpoints, ``synchronize_optimizer_state``).
A rate changed on a worker (a scheduler built and stepped there, as in a synchronous loop, or a
group's ``lr`` set by hand) would change nothing the server does; ``ServerSchedule`` notices it
at the worker's next push and refuses it, naming the fix, where before it was silently ignored.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distframe.errors import ConfigError
from distframe.optimizers.owned_scheduler import build_scheduler, scheduler_state

__all__ = ["ServerSchedule", "refuse_unstepped_scheduler"]

_FIX = ("schedule the server's rate instead: AsyncSGDOptimizer(model, ..., lr_scheduler=lambda opt: "
        "LambdaLR(opt, f)), which the server steps once per applied update (set the rate of a "
        "whole run by hand before serve(), on the server)")


def _scheduler_built_on(optimizer: Any) -> bool:
    """Whether a torch lr scheduler was built on ``optimizer``: building one wraps the instance's
    ``step`` to notice a scheduler stepped before it (torch's ``_wrapped_by_lr_sched`` mark)."""
    return bool(getattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched", False))


def refuse_unstepped_scheduler(owner: Any) -> None:
    """ConfigError on the server when a scheduler was built on the AsyncSGDOptimizer (or on the
    optimizer instance it was given) rather than passed as ``lr_scheduler=``: serve() steps
    only its own, so that one would never move the rate."""
    built = _scheduler_built_on(owner) or (
        owner.lr_scheduler is None and _scheduler_built_on(owner.wrapped_optimizer))
    if built:
        raise ConfigError("AsyncSGDOptimizer: an lr scheduler was built on the server's optimizer, "
                          f"and serve() never steps it; {_FIX}")


class ServerSchedule:
    """One rank's copy of the server's scheduler (``scheduler``, None without one) and the rates
    the optimizer itself last gave this rank's groups (built, loaded, synchronised), which a
    worker's push checks. ``replicated``: whether this rank's scheduler state is the server's
    (a worker's falls behind from its first pull until ``synchronize_optimizer_state``)."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.scheduler: Any = None
        self.replicated = True
        self._rates = _rates(param_groups)

    def build(self, builder: Callable[[Any], Any], optimizer: Any) -> None:
        if not callable(builder):
            raise ConfigError("AsyncSGDOptimizer lr_scheduler: pass a function that builds the "
                              "scheduler on the server's optimizer, such as lambda opt: LambdaLR(opt, f)")
        self.scheduler = build_scheduler(builder, optimizer, "AsyncSGDOptimizer")
        self._rates = _rates(optimizer.param_groups)

    def state(self) -> dict[str, Any] | None:
        return None if self.scheduler is None else scheduler_state(self.scheduler, "AsyncSGDOptimizer")

    def load(self, state: dict[str, Any] | None, param_groups: list[dict[str, Any]]) -> None:
        """The server's state (where saved and a scheduler is built): the groups, loaded with it,
        already hold the rates it had set."""
        if state is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state)
        self._rates = _rates(param_groups)
        self.replicated = True

    def settings_loaded(self, param_groups: list[dict[str, Any]]) -> None:
        """The server's group settings were copied here (``synchronize_parameters``): its rates
        are this rank's own from now on, not a change made by hand (the scheduler's state is not
        replicated by that)."""
        self._rates = _rates(param_groups)

    def saved(self, is_server: bool) -> dict[str, Any]:
        """What ``state_dict()`` adds: ``{"lr_scheduler": state}``, or nothing without a scheduler;
        ConfigError on a worker whose copy fell behind the server's (rank 0 writes the
        checkpoint's, so a stale one would resume the schedule where it began)."""
        if self.scheduler is None:
            return {}
        if not (is_server or self.replicated):
            raise ConfigError("AsyncSGDOptimizer: this worker's lr scheduler state is not the "
                              "server's; after training, call opt.synchronize_optimizer_state() on "
                              "every rank, then save")
        return {"lr_scheduler": self.state()}

    def before_push(self, owner: Any) -> None:
        """ConfigError when this worker's rates changed, or a scheduler was built on it; else
        this copy falls behind, as the server steps its scheduler for the update pushed."""
        rates = _rates(owner.param_groups)
        if _scheduler_built_on(owner):
            what = "an lr scheduler was built on this worker's AsyncSGDOptimizer"
        elif rates != self._rates:
            what = f"this worker's learning rate changed ({self._rates} -> {rates}, by param group)"
        else:
            self.replicated = False
            return
        raise ConfigError(f"AsyncSGDOptimizer (rank {owner.model.backend.rank}): {what}, but a worker "
                          f"pushes only its gradient and the server applies it at the server's rate, "
                          f"so the change would be ignored; {_FIX}")


def _rates(param_groups: list[dict[str, Any]]) -> list[Any]:
    """The groups' rates, by value (a tensor lr, as capturable optimizers take, changes in place)."""
    return [group["lr"].item() if hasattr(group["lr"], "item") else group["lr"] for group in param_groups]
