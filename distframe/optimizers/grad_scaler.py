"""ShardedGradScaler: torch.amp.GradScaler whose overflow decision agrees across the ranks that
step together, for optimizers whose ranks hold different gradients (ZeRO, FSDP, model parallel).

[Note: why the flags are agreed] GradScaler looks for inf/nan in the gradients of
``optimizer.param_groups``. Under DDP every rank holds the same averaged gradients and finds the
same. A sharded optimizer's ``param_groups`` hold this rank's shard only (a ZeRO chunk, an FSDP
unit's flat shard, a pipeline stage, a tensor slice), so one rank can find inf where another does
not: that rank skips ``optimizer.step()`` and the collectives inside it, the others wait for it,
and ``update()`` moves each rank's scale differently, so the next backward averages gradients
scaled by different factors. Here both ``unscale_`` and ``step``'s own check go through
``_unscale_grads_``, which ends with one all_reduce(MAX) of the flag, so every rank sees the
overflow any rank found (torch's FSDP1 ShardedGradScaler does the same).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.models.plain_optimizer_guard import models_stepped_by
from distframe.optimizers.base import ShardedOptimizerBase


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded training: use it as the plain one
    (``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(opt)``, ``scaler.step(opt)``,
    ``scaler.update()``).

    Collectives: each inf check (one per optimizer per iteration: in ``unscale_``, or in ``step``
    when ``unscale_`` was not called) first completes the model's gradient synchronisation
    (``synchronize_gradients()``, idempotent), then runs one all_reduce(MAX) of a one-element
    float32 flag on the scaler's device over the ranks that step together: the optimizer's
    ``model.backend`` for a distframe optimizer (for hybrid, pipeline and tensor-parallel models
    that is the world backend they were built on: every stage, tensor slice and replica), or
    ``backend`` for a plain torch.optim optimizer (over a model-parallel model's
    ``parameters()``: pass ``backend=model.backend``). Every rank then skips the same steps and
    keeps the same scale. On a pipeline only the last stage scales the loss; the other stages'
    scalers start their scale at ``init_scale`` in their first ``unscale_``/``step`` (build every
    stage's scaler with the same settings). A DDP optimizer needs none of this (a plain
    GradScaler agrees there), but the scaler works with it too; GradientCompressionOptimizer with
    error feedback needs it (``update()`` rescales its residuals, and ``step()`` tells it the scale
    they were made at, which torch no longer hands ``step()`` after ``unscale_``).
    ``AsyncSGDOptimizer`` is refused: its workers step on their own, so each worker keeps a plain
    GradScaler.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 backend: ICommunicationBackend | None = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.backend = backend
        # Optimizers checked for inf since the last update(), told there how the scale moved.
        self._stepped: list[weakref.ref[torch.optim.Optimizer]] = []

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As GradScaler.update; then every optimizer checked since the last update that keeps
        state in units of the loss scale (GradientCompressionOptimizer's error-feedback
        residuals) is handed new scale / old scale."""
        old = self._scale.clone() if self._enabled and self._scale is not None else None
        super().update(new_scale)
        stepped, self._stepped = self._stepped, []
        if old is None:
            return
        for ref in stepped:
            follow = getattr(ref(), "loss_scale_changed", None)
            if follow is not None:
                follow(self._scale.double() / old.double())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, ShardedOptimizerBase):
            # The loss scale of this step's gradients, for an optimizer that keeps state in its
            # units: once unscale_ has run, torch hands step() grad_scale=None.
            follow = getattr(optimizer, "gradients_scaled_by", None)
            if follow is not None and self._enabled and self._scale is not None:
                follow(self._scale)
            # Tells the optimizer the found-inf flag it is handed is every rank's (see its step).
            with optimizer.agreed_scaler_step():
                return super().step(optimizer, *args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # A pipeline stage that does not compute the loss never calls scale(): its scale starts
        # here at init_scale, as the last stage's did, and moves with it (the flags are agreed).
        if self._scale is None and self._growth_tracker is None and funcname in ("unscale_", "step"):
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        return super()._check_scale_growth_tracker(funcname)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        # The one hook both unscale_ and step's check (_check_inf_per_device) go through.
        group = self._group(optimizer)
        if not any(ref() is optimizer for ref in self._stepped):
            self._stepped.append(weakref.ref(optimizer))
        model = getattr(optimizer, "model", None)
        if isinstance(optimizer, ShardedOptimizerBase):
            optimizer.synchronize_gradients()  # the shards' gradients are complete before the check
        elif model is not None:
            model.synchronize_gradients()
        else:  # a plain optimizer over a model-parallel model's parameters: the same, first
            for owner in models_stepped_by(optimizer):
                owner.before_plain_step()
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # One flag per rank whatever its devices (a rank whose shard has no gradient still takes
        # part), kept on the scaler's device: update() and step() only sum the values.
        flag = torch.zeros(1, dtype=torch.float32, device=found_inf.device)
        for value in per_device.values():
            flag += value.to(found_inf.device)
        group.all_reduce(flag, ReduceOp.MAX)
        return {found_inf.device: flag.reshape(())}

    def _group(self, optimizer: torch.optim.Optimizer) -> ICommunicationBackend:
        """The ranks whose flags must agree; ConfigError where that cannot be decided."""
        if getattr(optimizer, "steps_independently", False):
            raise ConfigError(f"ShardedGradScaler agrees overflow across ranks that step together, but "
                              f"{type(optimizer).__name__}'s workers step on their own; give each worker "
                              "a plain torch.amp.GradScaler")
        model = getattr(optimizer, "model", None)
        if model is None:
            if self.backend is None:
                raise ConfigError(
                    "ShardedGradScaler: a plain torch.optim optimizer does not say which ranks step "
                    "with it; pass ShardedGradScaler(..., backend=model.backend) (the backend the "
                    "model was built on), or use torch.amp.GradScaler in a single process")
            return self.backend
        if self.backend is not None and self.backend is not model.backend:
            raise ConfigError(f"ShardedGradScaler: backend= is for plain torch.optim optimizers; "
                              f"{type(optimizer).__name__} agrees over its model's backend: leave "
                              "backend=None")
        return model.backend
