"""ShardedOptimizerBase: a torch.optim optimizer over a sharded model's local shards, with the
model's synchronisation points around each step."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from distframe.backends.types import ReduceOp
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.plain_optimizer_guard import adopted_by, global_closure_loss, shown_name
from distframe.models.sharded_state import RangeReader, ShardLayout
from distframe.models.state_checks import check_optimizer_pieces
from distframe.optimizers.instances import (adopt_instance, build_optimizer, check_dense_gradients,
                                           check_elementwise, check_instance_covers,
                                           check_optimizer_argument)
from distframe.optimizers.param_groups import GroupedShards, build_grouped, group_indices
from distframe.optimizers.sharded_state import hyperparameters, load_optimizer_pieces, optimizer_pieces


def state_reader(state: Any, owner: str) -> RangeReader:
    """The pieces of a sharded optimizer's merged ``state_dict()``; ConfigError for anything else."""
    if not isinstance(state, dict) or not isinstance(state.get("tensors"), dict):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"{owner}.load_state_dict takes every rank's state_dict() merged (keys 'tensors', 'scalars', "
            f"'param_groups'), got {got}; a torch.optim state dict, keyed by parameter position, cannot "
            "be mapped to the shards: resume from a sharded optimizer's state or a distframe checkpoint, "
            "or start the optimizer fresh")
    return RangeReader.from_tensors(state["tensors"])

class ShardedOptimizerBase(torch.optim.Optimizer):
    """Wraps a torch.optim optimizer built over ``model.local_parameter_shard()``.

    ``step()`` runs ``model.synchronize_gradients()`` (waits for this step's gradient
    collectives), the local update, then ``model.synchronize_parameters()`` (the strategy's
    parameter all_gather, if any). ``should_early_stop`` is one all_reduce(MAX).

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are the
    wrapped optimizer's, so learning-rate schedulers take it as they take a plain one (torch's
    ZeroRedundancyOptimizer is one too). It never calls the base class's constructor: step and
    state-dict hooks and ``add_param_group`` are not supported (ConfigError). Given an optimizer instance with several param
    groups, it keeps them, each with its own settings, over pieces of the shards (see
    param_groups.py).

    Loss scaling: ``param_groups`` hold this rank's shard, so ranks can disagree on whether the
    gradients overflowed; use ``distframe.ShardedGradScaler`` (one all_reduce(MAX) of the flag),
    as FSDP and DeepSpeed users do. Where ranks hold different gradients but step together (ZeRO,
    FSDP, the ZeRO optimizers of a hybrid model, ElasticOptimizer over those) a plain
    ``torch.amp.GradScaler`` raises ConfigError at ``scaler.step``. Over a DDPModel every rank
    holds the same averaged gradients (DDPOptimizer, GradientCompressionOptimizer, whose ranks
    all decompress the same sum, ElasticOptimizer on DDP), so a plain GradScaler agrees and is
    fine (not for compression with error feedback: its residuals follow the scale, which only
    ShardedGradScaler reports); AsyncSGDOptimizer's workers step on their own, each with a plain GradScaler.
    See [Note: GradScaler and sharded optimizers].
    """

    #: The model class this optimizer belongs with.
    model_class: type[ShardedModelBase] = ShardedModelBase
    #: Whether ranks step on their own (a parameter server's workers): a GradScaler's decision
    #: is then each rank's own, and ShardedGradScaler (a collective) is refused.
    steps_independently = False

    def __init__(self, model: ShardedModelBase, optimizer: Any, **optimizer_kwargs: Any) -> None:
        name = type(self).__name__
        # A model names the optimizer it needs (a hybrid model over a ZeRO-1 data-parallel group
        # names ZeRO1Optimizer without being a ZeRO1Model).
        if not isinstance(model, self.model_class) and getattr(model, "optimizer_name", None) != name:
            raise ConfigError(f"{name} belongs with {self.model_class.__name__}, got "
                              f"{type(model).__name__}; {self._instead(model, optimizer)}")
        check_elementwise(optimizer, model, name)
        check_dense_gradients(optimizer, name)
        check_optimizer_argument(optimizer, optimizer_kwargs, name)
        check_instance_covers(optimizer, model, name)
        self.model = model
        # An instance's param groups, kept over pieces of the shards (see param_groups.py), or None.
        self._grouped: GroupedShards | None = None
        self._group_names: list[list[str]] | None = None
        if isinstance(optimizer, torch.optim.Optimizer) and len(optimizer.param_groups) > 1:
            group_of, shard_group, self._group_names = group_indices(optimizer, model)
            self._grouped = GroupedShards(model.shard_layout(), group_of, shard_group,
                                          len(optimizer.param_groups), name)
            self.wrapped_optimizer = build_grouped(optimizer, self._grouped.groups)
        else:
            self.wrapped_optimizer = build_optimizer(optimizer, model.local_parameter_shard(),
                                                     optimizer_kwargs, name)
        self._stepping = False
        if isinstance(optimizer, torch.optim.Optimizer):
            self.wrapped_optimizer = adopt_instance(optimizer, self.wrapped_optimizer, self)
        else:  # stepped alone it skips the synchronisation around it: refused as a handed one is
            adopted_by(self.wrapped_optimizer, self, handed=False)
        self._scaler_flags_agreed = False
        model.attach_optimizer(self)

    def _instead(self, model: Any, optimizer: Any) -> str:
        """The call that works for ``model``, given the wrong one (the end of a ConfigError)."""
        shown = shown_name(optimizer)
        fix = getattr(model, "optimizer_name", None)
        if not isinstance(model, ShardedModelBase):
            wrapper = self.model_class.__name__
            return (f"{type(self).__name__} takes the wrapped model, not a module or its parameters: "
                    f"{type(self).__name__}({wrapper}(module, backend), {shown}, **kwargs), or the {wrapper} "
                    "already built over it")
        if fix.isidentifier():  # a sharded optimizer's class name
            return f"use {fix}(model, {shown}, **kwargs) for it"
        if model.accepts_plain_optimizer:
            return ("it takes a plain torch.optim optimizer over its parameters: "
                    f"{shown}(model.parameters(), **kwargs)")
        return f"use {fix} for it"

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.wrapped_optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.wrapped_optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.wrapped_optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(f"{type(self).__name__} shards the parameters of the model it was built "
                          "for; it cannot take more (wrap a model that holds them all)")

    # torch.optim.Optimizer's hooks: its constructor, which makes their registries, is not run
    # (torch's AttributeError said nothing useful), and nothing here would call them.
    def register_step_pre_hook(self, hook: Any) -> Any:
        raise self._hooks_unsupported("register_step_pre_hook", "before optimizer.step()")

    def register_step_post_hook(self, hook: Any) -> Any:
        raise self._hooks_unsupported("register_step_post_hook", "after optimizer.step()")

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        raise self._hooks_unsupported("register_state_dict_pre_hook", "before optimizer.state_dict()")

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        raise self._hooks_unsupported("register_state_dict_post_hook", "on what state_dict() returns")

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        raise self._hooks_unsupported("register_load_state_dict_pre_hook",
                                      "on the dict before optimizer.load_state_dict()")

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        raise self._hooks_unsupported("register_load_state_dict_post_hook",
                                      "after optimizer.load_state_dict()")

    def _hooks_unsupported(self, method: str, instead: str) -> ConfigError:
        return ConfigError(f"{type(self).__name__}.{method}: a sharded optimizer takes no torch.optim "
                           f"hooks (its step synchronises gradients and parameters around the local "
                           f"update, and its state_dict is this rank's pieces); run your code {instead} "
                           "in the training loop instead")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wrapped_optimizer!r})"

    # [Note: GradScaler and sharded optimizers] torch.amp.GradScaler.step hands an optimizer with
    # ``_step_supports_amp_scaling`` its scale and found-inf flag as the attributes ``grad_scale``
    # and ``found_inf`` and calls ``step()`` itself, leaving skipping and unscaling to it. So a
    # sharded optimizer learns that a scaler drives it, and ShardedGradScaler says (through
    # ``agreed_scaler_step``) that the flag is every rank's. A plain GradScaler's flag is this
    # rank's alone: refused before any collective, on every rank alike, overflow or not.
    @property
    def _step_supports_amp_scaling(self) -> bool:
        return not (self.steps_independently or self.model.replicates_gradients)

    @contextlib.contextmanager
    def agreed_scaler_step(self) -> Iterator[None]:
        """Used by ShardedGradScaler.step: the found-inf flag it hands ``step()`` is agreed."""
        self._scaler_flags_agreed = True
        try:
            yield
        finally:
            self._scaler_flags_agreed = False

    def _needs_sharded_scaler_because(self) -> str:
        """Why a plain GradScaler is refused (the ConfigError's middle)."""
        return ("holds this rank's shard of the gradients, so a plain torch.amp.GradScaler finds "
                "inf/nan on some ranks and not on others (they would skip different steps and keep "
                "different scales); ShardedGradScaler agrees on it across ranks")

    def _apply_grad_scaler(self) -> bool:
        """Takes what a GradScaler set for this step: False when it is to be skipped (inf/nan
        found); otherwise unscales the gradients if the scaler has not (no ``unscale_``)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return True
        if not self._scaler_flags_agreed:
            raise ConfigError(f"{type(self).__name__} {self._needs_sharded_scaler_because()}; use "
                              "distframe.ShardedGradScaler: scaler = ShardedGradScaler(device, ...)")
        self.synchronize_gradients()
        if float(found_inf) > 0:  # every rank skips: parameters and optimizer state stay as they are
            return False
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()  # as GradScaler.unscale_
            with torch.no_grad():
                for group in self.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(inv_scale.to(param.grad.device))
        return True

    def step(self, closure: Any = None) -> Any:
        """Skips the step when a (Sharded)GradScaler found inf/nan; otherwise ``_step``."""
        try:
            if closure is not None and getattr(self, "found_inf", None) is not None:
                # torch refuses step(opt, closure=...) but hands a positional one on: its backward
                # would add scaled gradients to the ones just unscaled.
                raise ConfigError(f"{type(self).__name__}: a closure cannot be used with a GradScaler "
                                  "(its gradients would stay scaled); call scaler.scale(loss).backward() "
                                  "yourself and scaler.step(optimizer) without a closure")
            if not self._apply_grad_scaler():
                return None
            return self._step(closure)
        except BaseException:
            # GradScaler deletes the grad_scale and found_inf it set only after a step that
            # returned: a later step would otherwise take this one's for its own.
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise

    def _step(self, closure: Any = None) -> Any:
        # A closure's backward makes the gradients to step: synchronised after each evaluation (a
        # hybrid model finishes no reduction at the end of backward, as the others do).
        if closure is None:
            self.synchronize_gradients()
        else:
            closure = self._taking_gradients(closure)
        self._stepping = True  # the wrapped optimizer steps here only (adopt_instance)
        try:
            loss = self.wrapped_optimizer.step(closure)
        finally:
            self._stepping = False
        self.model.synchronize_parameters()
        return loss

    def _taking_gradients(self, closure: Any) -> Any:
        """``closure``, after which the pieces take the gradients its backward gave the shards."""
        def run() -> Any:
            loss = closure()
            self.synchronize_gradients()
            return global_closure_loss(self.model, loss)
        return run

    def synchronize_gradients(self) -> None:
        """``model.synchronize_gradients()``; then, where param groups cut the shards into pieces,
        each piece's ``.grad`` is its range of its shard's gradient. No communication of its own."""
        self.model.synchronize_gradients()
        if self._grouped is not None:
            self._grouped.take_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped_optimizer.zero_grad(set_to_none=set_to_none)
        self.model.zero_grad(set_to_none=set_to_none)

    def gradients_cleared(self) -> None:
        """Called by the model's ``zero_grad``, whoever calls it: drop what was derived from the
        cleared gradients (the pieces' views of them; see GradientCompressionOptimizer too)."""
        if self._grouped is not None:
            self._grouped.take_gradients()

    def synchronize_optimizer_state(self) -> None:
        """Makes replicated optimizer state identical (rank 0's); sharded state needs nothing."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors this optimizer keeps beside its wrapped optimizer's state (error-feedback
        residuals, say), which ``model.memory_footprint()`` counts as optimizer state."""
        return []

    def synchronize_parameters(self) -> None:
        self.model.synchronize_parameters()

    def should_early_stop(self, local_flag: bool) -> bool:
        """True on every rank when any rank passes True (one all_reduce of a flag)."""
        flag = torch.tensor([1.0 if local_flag else 0.0])
        self.model.backend.all_reduce(flag, ReduceOp.MAX)
        return bool(flag.item() > 0)

    def state_dict(self) -> dict[str, Any]:
        """This rank's share: ``tensors`` (pieces keyed by parameter range), ``scalars`` (per
        parameter) and ``param_groups`` (hyperparameters)."""
        backend = self.model.backend
        layout = self._optimizer_layout()
        tensors, scalars = optimizer_pieces(layout, self.wrapped_optimizer, backend.rank, backend.world_size)
        return {"tensors": tensors, "scalars": scalars,
                "param_groups": hyperparameters(self.wrapped_optimizer, layout, self._group_names)}

    def load_state_dict(self, state: dict[str, Any], reader: RangeReader | None = None) -> None:
        """Loads state saved under any layout (merge every rank's ``tensors`` and ``scalars``);
        each param group takes the settings of the saved group that trained its parameters
        (ConfigError when the saved run grouped them otherwise, or for another model's state)."""
        reader = reader or state_reader(state, type(self).__name__)
        check_optimizer_pieces(reader, self.model.parameter_metadata(), self.model.replicated_names())
        load_optimizer_pieces(self._optimizer_layout(), self.wrapped_optimizer, reader,
                              state.get("scalars", {}), state.get("param_groups", []), self._group_names)

    def _optimizer_layout(self) -> ShardLayout:
        """What the wrapped optimizer's tensors hold: the model's shards, or their pieces."""
        return self.model.shard_layout() if self._grouped is None else self._grouped.layout

