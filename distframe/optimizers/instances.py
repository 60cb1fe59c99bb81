"""The torch.optim optimizer a sharded optimizer wraps: the class or instance a user passes, the
checks on it, and the instance rebuilt over the model's shards (and adopted: ``adopt_instance``)."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.plain_optimizer_guard import WHOLE_PARAMETER_OPTIMIZERS, adopted_by, adopter
from distframe.models.zero_grad_route import route_zero_grad


def build_optimizer(optimizer: Any, params: list[torch.Tensor], kwargs: dict[str, Any],
                    owner: str) -> torch.optim.Optimizer:
    """``optimizer`` is a torch.optim.Optimizer subclass (built with ``kwargs``) or an instance
    (re-built over ``params`` with its settings; it must not have taken a step yet, and its param
    groups, if several, must share their settings: ``params`` go into one group.
    ShardedOptimizerBase keeps an instance's groups instead: see ``param_groups``)."""
    check_optimizer_argument(optimizer, kwargs, owner)
    if isinstance(optimizer, type):
        return optimizer(params, **kwargs)
    settings = _shared_settings(optimizer, owner)
    # Pass what the constructor accepts (AdamW's defaults hold decoupled_weight_decay, which
    # its constructor refuses), then set every setting on the group as the instance had it.
    accepted = inspect.signature(type(optimizer).__init__).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        names = {p.name for p in accepted}
        rebuilt = type(optimizer)(params, **{k: v for k, v in settings.items() if k in names})
    else:
        rebuilt = type(optimizer)(params, **settings)
    for group in rebuilt.param_groups:
        group.update(settings)
    return rebuilt


# torch.optim.Optimizer's per-instance hook registries.
_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def adopt_instance(instance: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer,
                   owner: Any) -> torch.optim.Optimizer:
    """``instance`` (the optimizer a user passed) made the ``rebuilt`` one, over the shards: its
    param groups take the rebuilt one's tensors and settings in place (the same list and dicts),
    its state and defaults become the rebuilt one's, so what was built on it before the
    wrapping (an LR scheduler, a reference to set ``lr`` by hand, its ``state_dict()``) acts on
    the optimizer that trains (DeepSpeed, too, keeps the instance it is given). Stepping it
    directly would skip ``owner``'s synchronisation: plain_optimizer_guard refuses that. Its
    ``zero_grad`` is ``owner``'s, which clears the shards' gradients too (with several param
    groups it holds views of pieces of them): see zero_grad_route.py."""
    earlier = adopter(instance)
    if earlier is not None:
        raise ConfigError(f"this torch.optim.{type(instance).__name__} was already handed to a "
                          f"{type(earlier).__name__}, which trains with it; give each sharded "
                          "optimizer an instance of its own (or the class with keyword settings)")
    hooks = [name for name in _HOOK_REGISTRIES if getattr(instance, name, None)]
    if hooks:  # they would be dropped (the rebuilt one's registries replace them)
        raise ConfigError(f"the torch.optim.{type(instance).__name__} handed over has hooks ({hooks[0]}); "
                          "a sharded optimizer takes none: run that code around step() / state_dict() "
                          "in the training loop instead")
    # From a list, not the dict: instances of one class share their attribute dicts' keys in
    # CPython, and another rank's thread adding an attribute to its instance while this update
    # iterated ``rebuilt.__dict__`` raised "dict mutated during update" (in-memory ranks, the
    # first adoption of a class, about 1 run in 10 at 8 ranks). Making the list runs in C
    # without releasing the GIL.
    attributes = list(rebuilt.__dict__.items())
    # The param_groups list and its dicts stay the instance's, which the user (``head =
    # opt.param_groups[0]``) and a scheduler may hold: each takes its rebuilt group's tensors and
    # settings and keeps keys others put there (a scheduler's initial_lr). Groups of one setting
    # that build_optimizer made one leave the list; any beyond the instance's join it.
    groups = instance.param_groups
    for group, rebuilt_group in zip(groups, rebuilt.param_groups):
        group.update(rebuilt_group)
    del groups[len(rebuilt.param_groups):]
    groups.extend(rebuilt.param_groups[len(groups):])
    instance.__dict__.update([(name, value) for name, value in attributes if name != "param_groups"])
    route_zero_grad(instance, owner)
    adopted_by(instance, owner)
    return instance


def check_optimizer_argument(optimizer: Any, kwargs: dict[str, Any], owner: str) -> None:
    """ConfigError unless ``optimizer`` is a torch.optim.Optimizer class or a fresh instance
    (with no keyword settings beside it)."""
    if getattr(optimizer, "wrapped_optimizer", None) is not None or (
            isinstance(optimizer, type) and hasattr(optimizer, "model_class")):  # a ShardedOptimizer class
        raise ConfigError(f"{owner} wraps a torch.optim optimizer, got the sharded "
                          f"{getattr(optimizer, '__name__', type(optimizer).__name__)}; pass the "
                          f"torch.optim class, e.g. {owner}(model, torch.optim.AdamW, lr=3e-4)")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{owner}: optimizer must be a torch.optim.Optimizer class or instance, e.g. "
                          f"{owner}(model, torch.optim.AdamW, lr=3e-4); got {optimizer!r:.60}")
    if kwargs:
        raise ConfigError(f"{owner}: pass either an optimizer instance or a class with keyword "
                          f"settings, not both (got {sorted(kwargs)})")
    if _has_stepped(optimizer):
        raise ConfigError(f"{owner}: the optimizer instance has already taken steps; pass a "
                          "fresh one (or its class) so its state can be sharded from the start")


def check_dense_gradients(optimizer: Any, owner: str) -> None:
    """ConfigError for torch.optim.SparseAdam: every strategy averages gradients densely (in
    buckets or flat units; a sparse embedding's gradient is densified), and it takes only sparse ones."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if isinstance(cls, type) and issubclass(cls, torch.optim.SparseAdam):
        raise ConfigError(f"{owner}: torch.optim.SparseAdam steps sparse gradients only, but the "
                          "model's gradients are averaged as dense tensors (a sparse embedding's too); "
                          "use torch.optim.Adam or AdamW (which also step rows a batch did not touch)")


def check_elementwise(optimizer: Any, model: ShardedModelBase, owner: str) -> None:
    """ConfigError when ``model``'s local shards are flat chunks (not its parameters themselves)
    and ``optimizer`` (class or instance) is one of WHOLE_PARAMETER_OPTIMIZERS."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(cls, WHOLE_PARAMETER_OPTIMIZERS):
        return
    parameters = {id(p) for p in model.wrapped_model.parameters()}
    if all(id(shard) in parameters for shard in model.local_parameter_shard()):
        return  # whole parameters (DDP); tensor-parallel slices: plain_optimizer_guard
    raise ConfigError(
        f"{owner}: torch.optim.{cls.__name__} updates a parameter from the whole of it (its shape or "
        f"norm; LBFGS: from all parameters at once), but {type(model).__name__}'s optimizer updates "
        "flat chunks that split and mix parameters, so every step would differ from one process's; "
        "use an element-wise optimizer (AdamW, Adam, SGD, ...) or DDPModel, whose optimizer sees "
        "whole parameters")


def check_instance_covers(optimizer: Any, model: ShardedModelBase, owner: str) -> None:
    """ConfigError when ``optimizer`` is an instance that leaves out trainable parameters of
    ``model`` (rebuilt over the local shards, which hold every one, it would train them too) or
    holds tensors that are not the model's (the rebuilt one would drop them)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    known = {id(p) for p in model.parameters()} | {id(s) for s in model.local_parameter_shard()}
    outside = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in known)
    if outside:
        raise ConfigError(
            f"{owner}: the optimizer instance holds {outside} tensor(s) that are not parameters of the "
            f"wrapped model (a learned loss temperature, say); it is rebuilt over {type(model).__name__}'s "
            "local shards, so they would never be trained; register them in the model (an nn.Parameter "
            "of a module inside it, whose gradient is then averaged across ranks), or give them an "
            "optimizer of their own and average their gradients yourself")
    if all(id(shard) in given for shard in model.local_parameter_shard()):
        return  # built over the shards themselves
    missing = [n for n, p in model.wrapped_model.named_parameters() if p.requires_grad and id(p) not in given]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ConfigError(
            f"{owner}: the optimizer instance leaves out {len(missing)} trainable parameter(s) of the "
            f"model ({shown}), but it is rebuilt over {type(model).__name__}'s local shards, which hold "
            "every trainable parameter, so it would train them too; freeze them (requires_grad_(False)) "
            "before wrapping the model, or build the optimizer over model.parameters()")


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """State from a step (Adagrad creates state with step 0 at construction: not a step)."""
    return any("step" not in state or float(state["step"]) > 0 for state in optimizer.state.values())


def _shared_settings(optimizer: torch.optim.Optimizer, owner: str) -> dict[str, Any]:
    """The settings every param group of ``optimizer`` has; ConfigError when groups differ."""
    groups = [{k: v for k, v in g.items() if k in optimizer.defaults} for g in optimizer.param_groups]
    differing = sorted({k for g in groups[1:] for k in g if g[k] != groups[0].get(k)})
    if differing:
        raise ConfigError(
            f"{owner}: the optimizer instance has {len(groups)} param groups with different "
            f"{differing}, but build_optimizer puts the parameters into one group; pass one group (or "
            "the class with keyword settings), or hand the instance to a distframe optimizer "
            "(ZeRO2Optimizer(model, opt), ...), which keeps its groups")
    return groups[0]
