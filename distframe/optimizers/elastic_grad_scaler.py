"""The GradScaler an ElasticOptimizer commits: which scaler it is (``grad_scaler=``), its state as a
commit holds it, and the refusals that keep an unregistered scaler from diverging the replicas.

A scaler's scale is as much a part of the training state as the optimizer's: gradients scaled by
different factors are averaged, then each rank unscales by its own, so every rank must use the
same scale at every step. A joiner gets it from the commit it receives, survivors rolled back get
back the scale of the commit, and a restart from a checkpoint the scale of the checkpoint (as
DeepSpeed's engine and Horovod's elastic ``TorchState`` hold their loss scaler).

[Note: the scale a commit holds] ElasticOptimizer commits inside ``optimizer.step()``, which
``scaler.step(optimizer)`` calls before the user's ``scaler.update()``: the scaler then still holds
the scale of the step just taken. A commit must hold what the next step uses, so while the scaler
has not updated since it drove this optimizer's step, the committed state is the one ``update()``
will make: torch's own ``_amp_update_scale_`` applied to a copy, with the inf flags the scaler
recorded (what update() combines). "Not updated since" is read from the scaler's record of the
step (``_per_optimizer_states[id(optimizer)]``), which update() replaces with a fresh one. A commit
made before the step (a state loaded by hand, committed by the next ``step()``) or after
``update()`` holds the scaler's state as it is. ``update(new_scale)`` is not foreseen.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.optimizers.grad_scaler import ShardedGradScaler


class CommittedGradScaler:
    """The GradScaler (``scaler``; None: none registered) whose state an ElasticOptimizer
    commits, and what the optimizer saw of scalers driving its steps (``unregistered``: a
    GradScaler drove ``step()`` while none was registered). No communication of its own."""

    def __init__(self, scaler: torch.amp.GradScaler | None, model: Any) -> None:
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(f"ElasticOptimizer grad_scaler={scaler!r}: pass the torch.amp.GradScaler "
                              "(or distframe.ShardedGradScaler) that drives this optimizer's steps, or None")
        if (scaler is not None and not isinstance(scaler, ShardedGradScaler)
                and not getattr(model, "replicates_gradients", False)):
            raise ConfigError(f"ElasticOptimizer over {type(model).__name__} holds this rank's shard of "
                              "the gradients, so a plain torch.amp.GradScaler would find inf/nan on some "
                              "ranks and not on others; use distframe.ShardedGradScaler(device, ...)")
        self.scaler = scaler
        self.unregistered = False
        self._stepped: dict[str, Any] | None = None  # the scaler's record of the last step it drove
        if scaler is not None:
            # A scaler kept from a group that failed inside scaler.step still holds that step's
            # inf checks, which its next update() would take for this group's.
            scaler._per_optimizer_states.clear()

    def saw_scaled_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called when a GradScaler hands ``optimizer.step()`` its found-inf flag."""
        if self.scaler is None:
            self.unregistered = True
            return
        record = self.scaler._per_optimizer_states.get(id(optimizer))
        if record is None:  # the registered scaler never saw this step: another one drives it
            raise ConfigError("ElasticOptimizer: scaler.step(optimizer) was called with a GradScaler "
                              "other than the one passed as grad_scaler=; step through that one, whose "
                              "state the commits hold")
        self._stepped = record

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The scaler's ``state_dict`` (JSON) as the next step will find it ([Note: the scale a
        commit holds]); None without an enabled scaler."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        state = self.scaler.state_dict()
        records = self.scaler._per_optimizer_states
        if self._stepped is not None and records.get(id(optimizer)) is self._stepped:
            state = _after_update(state, records.values())
        return state

    def load(self, state: dict[str, Any] | None) -> None:
        """Gives the registered scaler a committed or checkpointed state (None: leaves it)."""
        if state is not None and self.scaler is not None:
            self.scaler.load_state_dict(state)
            self._stepped = None


def _after_update(state: dict[str, Any], records: Any) -> dict[str, Any]:
    """``state`` after the ``update()`` that the scaler's ``records`` of this iteration lead to."""
    found_inf = sum(float(flag.sum()) for record in records
                    for flag in record["found_inf_per_device"].values())
    scale = torch.tensor([state["scale"]], dtype=torch.float32)
    tracker = torch.tensor([state["_growth_tracker"]], dtype=torch.int32)
    torch._amp_update_scale_(scale, tracker, torch.tensor([found_inf], dtype=torch.float32),
                             state["growth_factor"], state["backoff_factor"], state["growth_interval"])
    return {**state, "scale": scale.item(), "_growth_tracker": int(tracker.item())}


def agreed_state(states: Sequence[dict[str, Any] | None], step: int) -> dict[str, Any] | None:
    """The GradScaler state that every rank's piece of the commit of ``step`` holds (rank order);
    ConfigError, raised on every rank alike, where they differ."""
    if all(s == states[0] for s in states):
        return states[0]
    given = [r for r, s in enumerate(states) if s is not None]
    if len(given) < len(states):
        missing = [r for r, s in enumerate(states) if s is None]
        raise ConfigError(f"ElasticOptimizer: ranks {given} passed grad_scaler= and ranks {missing} did "
                          "not (or theirs is disabled); every worker must pass its GradScaler: "
                          "ElasticOptimizer(model, ..., grad_scaler=scaler)")
    scales = [s["scale"] for s in states if s is not None]
    raise ConfigError(f"ElasticOptimizer: the ranks' GradScalers differ at step {step} (scales {scales}); "
                      "build every worker's scaler with the same settings and step only through it "
                      "(scaler.step(optimizer), then scaler.update())")


def refuse_unregistered(commit_step: int) -> None:
    """The commit of ``commit_step`` was made while a GradScaler drove the steps unregistered."""
    raise ConfigError(
        f"ElasticOptimizer: the commit of step {commit_step} was made while a GradScaler drove step() "
        "but was not registered, so it holds no loss scale: a worker that joins would start from "
        "a fresh scale, survivors would keep the scale they had grown since, and the replicas "
        "would diverge. Pass the scaler to every worker's ElasticOptimizer(model, ..., "
        "grad_scaler=scaler): commits then hold its state and give it back")
