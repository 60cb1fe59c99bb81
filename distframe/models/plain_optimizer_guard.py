"""A plain torch.optim optimizer stepping the parameters of a model whose strategy needs its own
optimizer is refused at ``step()``.

[Note: plain optimizers over sharded models] FSDP2's users build ``AdamW(model.parameters())``
after wrapping (its parameters are DTensors and carry their sharded gradients). Here ZeRO-1/2/3,
FSDP and a hybrid model over ZeRO keep the reduced gradients in flat shards that only their own
optimizer (``model.optimizer_name``) steps: a plain optimizer over ``model.parameters()`` found
``.grad`` None (ZeRO-2/3, FSDP: nothing trained) or each rank's own un-averaged gradient (ZeRO-1:
the replicas drifted apart), without a word. ``guard(model)`` adds the model to a weak set, and
one global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed
once) raises ConfigError, before anything moves, when an optimizer's param groups hold a
parameter of a live guarded model that ``accepts_plain_optimizer`` is False for, other than its
flat shards (which its own optimizer steps). Cost per step of any optimizer in the process: one
set lookup per parameter and guarded model (about 20 us for 1000 parameters).

[Note: whole-parameter optimizers over tensor-parallel slices] A model that takes plain
optimizers (tensor parallel, hybrid over DDP) holds 1/tp of each split parameter. Adafactor
factors a parameter's matrix, Muon orthogonalises it and LBFGS takes every parameter at once
(WHOLE_PARAMETER_OPTIMIZERS): over slices each computes something other than one process's
step, so the same hook refuses them when a param group holds such a slice (tp > 1).

The same hook also notes, on a model that takes plain optimizers, those that step its parameters
(weak references: ``plain_optimizers(model)``), so that ``memory_footprint()`` counts their
state: a plain loop never hands the optimizer to the model. And it calls the model's
``before_plain_step()`` first (after each evaluation of a closure the step is given): a
model-parallel model synchronises its gradients there (tied weights across stages, data-parallel
replicas), which ``train_step`` does and a hand-written ``loss.backward(); opt.step()`` did not,
so each replica stepped its own gradient without a word (ShardedGradScaler does the same before
its inf check: ``models_stepped_by``).
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distframe.errors import ConfigError

# torch.optim optimizers whose update of a parameter reads the whole of it (Adafactor factors a
# matrix's second moment and scales by its norm, Muon orthogonalises a matrix) or of every
# parameter at once (LBFGS): over flat chunks or tensor-parallel slices they would compute
# another update than one process, with no error.
WHOLE_PARAMETER_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "Muon")
                                   if hasattr(torch.optim, name))

_guarded: weakref.WeakSet[Any] = weakref.WeakSet()
_adopted: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # optimizer -> its owner
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


def plain_optimizers(model: Any) -> list[torch.optim.Optimizer]:
    """The plain torch.optim optimizers, still alive, that have stepped ``model``'s parameters."""
    return list(model.__dict__.get("_plain_optimizers", ()))


def models_stepped_by(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The live guarded models that take plain optimizers and whose parameters ``optimizer``
    holds (noting it on them, see ``plain_optimizers``)."""
    params = _params(optimizer)
    with _lock:  # a rank thread may be adding one
        models = list(_guarded)
    stepped = [m for m in models if m.accepts_plain_optimizer and _note_plain_optimizer(optimizer, m, params)]
    return in_step_order(stepped, params)


def in_step_order(models: list[Any], params: list[torch.Tensor]) -> list[Any]:
    """``models`` by where their first parameter comes in ``params`` (the optimizer's): the same
    order on every rank, where a WeakSet's follows object ids; their synchronisations communicate."""
    if len(models) < 2:  # every optimizer step of the process comes here: most step no model or one
        return models
    position = {id(p): i for i, p in enumerate(params)}
    return sorted(models, key=lambda m: min((position[id(q)] for q in m.parameters() if id(q) in position),
                                            default=len(position)))


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _holds_any(ids: set[int], params: list[torch.Tensor]) -> bool:
    return not ids.isdisjoint(map(id, params))


def _note_plain_optimizer(optimizer: torch.optim.Optimizer, model: Any, params: list[torch.Tensor]) -> bool:
    ids = model.__dict__.get("_plain_optimizer_ids")
    if ids is None:
        try:
            model.local_parameter_shard()
        except AttributeError:  # still being built on another thread (an in-memory rank)
            return False
        ids = {id(p) for p in model.parameters()}
        model.__dict__["_plain_optimizer_ids"] = ids
    if _holds_any(ids, params):
        model.__dict__.setdefault("_plain_optimizers", weakref.WeakSet()).add(optimizer)
        return True
    return False


def adopted_by(optimizer: torch.optim.Optimizer, owner: Any, *, handed: bool = True) -> None:
    """``optimizer`` is the sharded ``owner``'s wrapped optimizer from now on: stepping it other
    than from ``owner.step()``, or after a param group was added to it, is refused. ``handed``: an
    instance a user handed to ``owner``, now rebuilt over its shards; else the one ``owner`` built
    from a class (its public ``wrapped_optimizer``)."""
    _adopted[optimizer] = (weakref.ref(owner), frozenset(map(id, _params(optimizer))), handed)


def adopter(optimizer: torch.optim.Optimizer) -> Any:
    """The live sharded optimizer ``optimizer`` was handed to, or None."""
    entry = _adopted.get(optimizer)
    return entry[0]() if entry is not None else None


def _refuse_step_outside_owner(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    owner = adopter(optimizer)
    if owner is None:
        return
    name = type(owner).__name__
    if not owner._stepping and not _adopted[optimizer][2]:  # noqa: SLF001 (set by ShardedOptimizerBase)
        raise ConfigError(
            f"{name}.wrapped_optimizer.step() steps alone what {name}.step() steps between the model's "
            "gradient synchronisation (which ends at the step where backward could not end it: after "
            "no_sync, on ranks sharing a GPU, under compression) and its parameter synchronisation "
            "(ZeRO-1/2's all_gather of every rank's updated chunk into the weights the forward uses), "
            f"which this call skips; call {name}.step() instead, and hand that {name}, not its "
            "wrapped_optimizer, to whatever steps it")
    if not owner._stepping:  # noqa: SLF001 (set by ShardedOptimizerBase)
        raise ConfigError(
            f"this torch.optim.{type(optimizer).__name__} was handed to {name}, which now steps it "
            f"over the model's shards between the gradient and parameter synchronisation; call "
            f"that {name}'s step() instead (and pass that {name} to a GradScaler)")
    if not _adopted[optimizer][1].issuperset(map(id, params)):
        raise ConfigError(
            f"a param group was added to the torch.optim.{type(optimizer).__name__} handed to {name} "
            "(add_param_group), whose tensors no strategy synchronises, so the ranks would drift "
            "apart; register them in the model before wrapping it")


def _refuse_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
    params = _params(optimizer)
    _refuse_step_outside_owner(optimizer, params)
    with _lock:  # a rank thread may be adding one
        models = list(_guarded)
    whole = isinstance(optimizer, WHOLE_PARAMETER_OPTIMIZERS)
    stepped = []
    for model in models:
        if whole:
            _refuse_whole_over_slices(optimizer, model)
        if model.accepts_plain_optimizer:
            if _note_plain_optimizer(optimizer, model, params):
                stepped.append(model)
            continue
        ids = _guarded_ids(model)
        if _holds_any(ids, params):
            name = model.optimizer_name
            raise ConfigError(
                f"a plain torch.optim.{type(optimizer).__name__} over a {type(model).__name__}'s "
                f"model.parameters() never sees the reduced gradients, which live in the model's flat "
                f"shards; build {name}(model, torch.optim.{type(optimizer).__name__}, **kwargs) instead "
                "(it takes a class or an instance)")
    return synchronizing(in_step_order(stepped, params), args, kwargs)


def synchronizing(models: list[Any], args: tuple, kwargs: dict) -> tuple | None:
    """Runs each model's ``before_plain_step()`` now, or, for a step given a closure (LBFGS needs
    one), returns the step's arguments (``args[0]``: the optimizer) with a closure that runs it
    after each evaluation: the gradients to synchronise are the ones the closure's backward makes
    (synchronised first, each replica stepped its own slice's, 0.16 off one process, without a
    word). The closure's loss becomes the global mean (``global_closure_loss``)."""
    try:
        bound = _step_signature(type(args[0])).bind_partial(*args, **kwargs) if models else None
    except TypeError:  # arguments step() does not take: its own call raises torch's error for them
        bound = None
    closure = None if bound is None else bound.arguments.get("closure")
    if closure is None:
        for model in models:
            model.before_plain_step()
        return None

    def synchronized() -> Any:
        loss = closure()
        for model in models:
            model.before_plain_step()
        return global_closure_loss(models[0], loss)
    bound.arguments["closure"] = synchronized
    return bound.args, bound.kwargs


@functools.lru_cache(maxsize=None)
def _step_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.step)


def global_closure_loss(model: Any, loss: Any) -> Any:
    """``loss``, a closure's, as the mean over the global batch (``model``'s, as train_step returns
    it), a tensor of its dtype where it was one; None stays None. What the optimizer reads of it
    then is one process's: LBFGS's line search branches on it, and with each rank's own slice's
    the replicas stepped apart (1.6) and their collectives went out of step."""
    if loss is None:
        return None
    mean = model._global_mean_loss(torch.as_tensor(loss).detach())  # noqa: SLF001 - train_step's
    return torch.as_tensor(mean, dtype=loss.dtype, device=loss.device) if torch.is_tensor(loss) else mean


def _refuse_whole_over_slices(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """See [Note: whole-parameter optimizers over tensor-parallel slices]."""
    from distframe.models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                  ShardedLayerNorm, VocabParallelEmbedding)
    split = (ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm, VocabParallelEmbedding)
    slices = {id(p) for m in model.modules() if isinstance(m, split) and m.backend.world_size > 1
              for p in (m.weight, getattr(m, "bias", None)) if p is not None}
    slices -= {id(m.bias) for m in model.modules() if isinstance(m, RowParallelLinear) and m.bias is not None}
    if any(id(p) in slices for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError(
            f"torch.optim.{type(optimizer).__name__} over a {type(model).__name__}'s tensor-parallel "
            "slices: it updates a parameter from the whole of it (its shape or norm; LBFGS: all "
            "parameters at once), but each rank holds 1/tp of a split parameter, so every step "
            "would differ from one process's; use an element-wise optimizer (AdamW, Adam, SGD, ...) "
            "or leave those layers out of the tensor-parallel plan")


def shown_name(optimizer: Any) -> str:
    """How a message names the torch.optim class of ``optimizer`` (a class or an instance) in a
    call that builds one: ``torch.optim.SGD`` for torch's own, ``torch.optim.AdamW`` for what is
    none (a sharded optimizer, say)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(cls, torch.optim.Optimizer) or hasattr(cls, "model_class"):  # a ShardedOptimizer's
        return "torch.optim.AdamW"
    return f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls else cls.__name__


def refuse_in_train_step(optimizer: Any) -> None:
    """ConfigError for an optimizer that ``model.train_step`` cannot step: one whose ranks step on
    their own (train_step all-reduces the loss, which no parameter server joins), or whose
    ``step`` needs a closure (LBFGS evaluates the loss several times per step; train_step runs one
    forward and backward and calls ``step()``: torch's TypeError came from inside LBFGS)."""
    if isinstance(optimizer, type):  # torch's AttributeError came from the step's signature below
        inner = shown_name(optimizer)
        raise ConfigError(
            f"train_step takes an optimizer instance, got the class {optimizer.__name__} itself: build the "
            f"optimizer of the model's strategy over it first (model.optimizer_name names it), e.g. "
            f"DDPOptimizer(model, {inner}, lr=...) for a DDPModel, ZeRO2Optimizer(model, {inner}, lr=...) "
            "for a ZeRO2Model; a model that takes plain optimizers (DDP, tensor and pipeline parallel) "
            f"also takes {inner}(model.parameters(), lr=...)")
    name = type(optimizer).__name__
    if getattr(optimizer, "steps_independently", False):
        raise ConfigError(f"{name}'s ranks step on their own, and model.train_step all-reduces the loss: "
                          "call optimizer.train_step(batch, loss_fn) (on its server: optimizer.serve())")
    inner = getattr(optimizer, "wrapped_optimizer", optimizer)
    closure = inspect.signature(type(inner).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"torch.optim.{type(inner).__name__}.step needs a closure (it evaluates the loss several times "
            "per step), which model.train_step does not give: write the loop instead, def closure(): "
            "optimizer.zero_grad(); loss = loss_fn(model(inputs), targets); loss.backward(); return "
            "loss, then optimizer.step(closure) (a pipeline runs its stages in train_step only: pick "
            "another optimizer there)")
