"""UnitShardedModelBase: what ZeRO-3 and FSDP share once their units are chosen, and the rule
both follow to place a parameter that several modules share (``parameter_homes``).

[Note: shared parameters] A Parameter registered by several modules (an LM's embedding weight
tied to its head) is used in the forward of each of them, so it must be gathered for the whole
span in which any of them runs. It therefore belongs to the unit of the lowest common ancestor
of the modules registering it (its "home"; a container that is never called, ModuleList or
ModuleDict, hands it up to its parent): that module's forward and backward enclose every use.
It is one entry of that unit's flat space, so it is stored once, autograd sums the gradients of
all its uses into its one ``.grad`` before its post-accumulate-grad hook fires, and the sum is
reduce-scattered once with the unit. It is named as ``named_parameters()`` names it (the first
name, as DDPModel and checkpoints do); ``gather_full_parameters()`` also returns it under every
other name the unwrapped model's ``state_dict()`` has for it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError, DistFrameError
from distframe.models.config import ShardingConfig, TrainingState
from distframe.models.direct_calls import DirectCalls
from distframe.models.full_parameters import Summonable
from distframe.models.master_weights import MasterChunk, MasterWeightsModelBase
from distframe.models.module_state_guard import guard_module_state
from distframe.models.replaced_data import AttachedData
from distframe.models.replicas import mark_wrapped
from distframe.models.sharded_state import ShardLayout
from distframe.models.sharded_unit import ShardedUnit
from distframe.models.stand_in_fast_paths import reads_checked
from distframe.models.stand_in_reads import StandInReads
from distframe.models.unit_lifecycle import UnitLifecycle
from distframe.models.unit_order import forward_orders, in_backward
from distframe.models.zero import cast_frozen, single_dtype
from distframe.precision import MixedPrecisionPolicy

UnitSpec = tuple[nn.Module, list[tuple[str, nn.Parameter]]]


class UnitShardedModelBase(MasterWeightsModelBase):
    """Parameters, gradients and optimizer state all sharded, per unit (see ShardedUnit and
    UnitLifecycle for the collectives). Each rank holds its master chunk of every unit, the
    gradient of that chunk after synchronisation, and optimizer state for it; full parameters
    of a unit exist only between its gather and its reshard (a unit kept gathered, below
    ``replicate_below_numel``, holds them between steps, gathered again by each optimizer step).
    Floating forward inputs are cast to ``param_dtype``; parameters edited in place reach the
    masters where the unit is gathered, and are refused where it holds stand-ins (master_weights.py);
    a replaced ``.data`` reaches them either way (replaced_data.py)."""

    def __init__(self, module: nn.Module, backend: ICommunicationBackend, *,
                 config: ShardingConfig | None = None, **settings: Any) -> None:
        super().__init__(module, backend, config=config, **settings)
        module = self.wrapped_model  # the module itself where a torch.compile'd one was given
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        single_dtype(named, type(self).__name__)  # ConfigError unless the trainable ones share one
        refuse_sparse_gradients(module, type(self).__name__)
        policy = self.config.mixed_precision or MixedPrecisionPolicy()
        self._input_dtype = policy.input_dtype
        chosen = self._choose_units(module)
        mark_wrapped(module, type(self).__name__)  # checks done: the module changes from here
        cast_frozen(module, policy.param_dtype)
        self.units = [
            ShardedUnit(i, owner, params, backend, policy,
                        persistent=sum(p.numel() for _, p in params) < self.config.replicate_below_numel)
            for i, (owner, params) in enumerate(chosen)]
        self.lifecycle = UnitLifecycle(self.units, module,
                                       reshard_after_forward=self.config.reshard_after_forward,
                                       prefetch=self.config.prefetch, misuse_error=self._misused_unit_error,
                                       usage=self._parameter_usage)
        # See [Note: one forward order on every rank] in unit_order.py.
        self._unit_order_unchecked = self.config.check_structure
        # See [Note: reads of a resharded parameter] in stand_in_reads.py.
        resharded = [u for u in self.units if not u.persistent]
        self._stand_in_pointers = frozenset().union(*(u.stand_in_pointers for u in resharded))
        guard_module_state(module, self._stand_in_pointers, type(self).__name__)
        self._unit_of_param = {id(e.param): (u, e.name) for u in self.units for e in u.space.entries}
        self._attached = [u.attached for u in self.units]  # see [Note: a replaced .data]
        self._reads_seen: set[tuple[str, bool, bool]] = set()  # kinds of call checked without a read
        # Last: its pre-hook runs before the units' (prepended too), and a refused construction adds none.
        self._direct_calls = DirectCalls(self)  # [Note: the wrapped module called directly]

    def _choose_units(self, module: nn.Module) -> list[UnitSpec]:
        """(module whose hooks gather the unit, its (name, parameter) list), trainable only."""
        raise NotImplementedError

    def _unit_fix(self, name: str) -> str:
        """How to choose units so that the module ``name`` is not one whose forward never runs."""
        raise NotImplementedError

    def _misused_unit_error(self, unit: ShardedUnit, what: str) -> ConfigError:
        """See [Note: a unit whose forward does not run] in unit_lifecycle.py."""
        name = self._module_name(unit.module)
        shown = f"'{name}'" if name else "the wrapped model"
        return ConfigError(
            f"{type(self).__name__}: unit {shown} ({type(unit.module).__name__}) is gathered by its "
            f"forward's hooks, but {what}, so it would compute with freed or stale parameters; call "
            f"{shown} as a whole (not only its submodules, as self.{name or 'model'}[i](x) would) and use "
            f"its parameters only inside that call, or {self._unit_fix(name)}")

    def _shared_unit_fix(self, unit_name: str) -> str:
        """How to choose units so that a parameter of unit ``unit_name`` is gathered where it is read."""
        raise NotImplementedError

    def _stand_in_read_error(self, param: nn.Parameter, where: str) -> ConfigError:
        """``param`` was read while its unit held stand-ins: see [Note: reads of a resharded
        parameter] in stand_in_reads.py. ``where``: "model's forward" or "loss function"."""
        if id(param) not in self._unit_of_param:  # a stand-in of another ZeRO-3/FSDP model (a teacher)
            return ConfigError(
                f"{type(self).__name__}: a parameter of shape {tuple(param.shape)} that another ZeRO3Model "
                f"or FSDPModel holds resharded (a NaN stand-in) was read in the {where}; read it inside that "
                "model's forward, or in its summon_full_parameters()")
        unit, name = self._unit_of_param[id(param)]
        if not unit.forward_ran:  # see [Note: a unit whose forward does not run] in unit_lifecycle.py
            return self._misused_unit_error(unit, f"its parameter '{name}' was read in the {where} "
                                                  "before the unit's forward ran")
        unit_name = self._module_name(unit.module)
        read = (f"{type(self).__name__}: parameter '{name}' was read in the {where} outside the forward of "
                f"its unit '{unit_name}' ({type(unit.module).__name__}), which had resharded it: between "
                "uses it holds a NaN stand-in, so what it computes would be NaN (in training, then every "
                "parameter). ")
        kept = ("ShardingConfig(reshard_after_forward=False) keeps each unit gathered from its forward to "
                f"its backward, so the {where} may read it (more memory); to read or edit weights outside "
                "forward and backward, use model.summon_full_parameters()")
        if where == "model's forward":
            return ConfigError(read + "Read it only inside the forward of a module that registers it: "
                                      f"{self._shared_unit_fix(unit_name)}; or " + kept)
        return ConfigError(read + "An L2 penalty is the optimizer's weight_decay (torch's SGD and Adam "
                                  "add weight_decay * p to the gradient, the gradient of weight_decay/2 * "
                                  "sum(p**2)); or " + kept)

    @contextlib.contextmanager
    def _reads_checked(self, where: str) -> Iterator[None]:
        """While inside, a read of a parameter holding its stand-in raises: the first time for each
        kind of call (``where``, grad mode, training mode), every time when the backend debugs.
        See [Note: which calls are checked] in stand_in_reads.py."""
        kind = (where, torch.is_grad_enabled(), self.wrapped_model.training)
        every_call = getattr(self.backend, "debug", False)
        if not self._stand_in_pointers or (kind in self._reads_seen and not every_call):
            yield
            return
        mode = StandInReads(self._stand_in_pointers, lambda param: self._stand_in_read_error(param, where))
        with reads_checked(mode, self._call[0]):
            yield
        self._reads_seen.add(kind)  # only once the call completed: one that raised is checked again

    def forward_backward(self, batch: tuple[Any, Any], loss_fn: Callable) -> torch.Tensor:
        """As ShardedModelBase's, with the loss function's reads checked (stand_in_reads.py)."""
        def checked_loss(output: Any, targets: Any) -> torch.Tensor:
            with self._reads_checked("loss function"):
                return loss_fn(output, targets)
        return super().forward_backward(batch, checked_loss)

    def _module_name(self, module: nn.Module) -> str:
        return next(n for n, m in self.wrapped_model.named_modules(remove_duplicate=False) if m is module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As ShardedModelBase's; torch's error for a parameter read while its unit was freed
        ("setStorage: ... out of bounds for storage of size 0") becomes a ConfigError naming it, and
        so does a read of a parameter holding its stand-in (stand_in_reads.py)."""
        try:
            with self._reads_checked("model's forward"):
                return super().forward(*args, **kwargs)
        except BaseException as error:
            # torch's words for reading freed storage: say which unit (found before any is freed)
            found = (self._unit_in_use_while_freed(error) if isinstance(error, RuntimeError)
                     and not isinstance(error, DistFrameError) else None)
            self.lifecycle.forward_raised()  # a bad batch skipped: no unit stays gathered
            if found is None:
                raise
            unit, module = found
            raise self._misused_unit_error(
                unit, f"'{self._module_name(module)}' ran while it was not gathered") from error

    def _unit_in_use_while_freed(self, error: BaseException) -> tuple[ShardedUnit, nn.Module] | None:
        """The innermost module whose forward was running when ``error`` was raised (by the
        traceback's frames) and that registers a parameter of a unit not gathered then, with that
        unit; None if there is none (a failure inside a hook's gather is not in a forward)."""
        freed = {id(p): unit for unit in self.units if not unit.is_unsharded for p in unit.params}
        frames, trace = [], error.__traceback__
        while trace is not None:
            frames.append(trace.tb_frame)
            trace = trace.tb_next
        for frame in reversed(frames):
            module = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if isinstance(module, nn.Module):
                for param in module.parameters(recurse=False):
                    if id(param) in freed:
                        return freed[id(param)], module
        return None

    # ---- ShardedModelBase ----------------------------------------------------------------------
    def _pre_forward(self) -> None:
        if torch.is_grad_enabled():
            self._take_in_place_edits()  # before any unit gathers
        self.lifecycle.begin_forward(self._synchronize)

    def _post_forward(self, output: Any) -> Any:
        self.lifecycle.end_forward(output)
        if torch.is_grad_enabled() and (self._unit_order_unchecked or getattr(self.backend, "debug", False)):
            self._unit_order_unchecked = False
            self._check_unit_order(self.lifecycle.forward_order)
        return output

    def _check_unit_order(self, order: list[int]) -> None:
        """ConfigError on every rank unless the units' forward ``order`` is the same on all of them
        (one small all_gather; see [Note: one forward order on every rank] in unit_order.py)."""
        device = self.units[0].master.device if self.units else torch.device("cpu")
        orders = forward_orders(order, len(self.units), self.backend, device)
        if all(other == orders[0] for other in orders):
            return
        ranks_by_order: dict[str, list[int]] = {}
        for rank, ran in enumerate(orders):
            names = ", ".join(repr(self._module_name(self.units[i].module) or "<root>") for i in ran)
            ranks_by_order.setdefault(names, []).append(rank)
        told = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} ran {names}"
                         for names, r in ranks_by_order.items())
        raise ConfigError(
            f"{type(self).__name__}: the units' modules ran in a different order on different ranks "
            f"in this forward ({told}), so each all_gather paired one unit's shard with another "
            "unit's and the parameters were mixed across ranks; call the modules in the same order "
            "on every rank (no branch on the rank or on data that differs across ranks). "
            "ShardingConfig(check_structure=False) skips this check of the first forward")

    def synchronize_gradients(self) -> None:
        self._take_in_place_edits()  # before the optimizer steps the masters
        self.lifecycle.finish()

    def synchronize_parameters(self) -> None:
        """Units kept gathered between steps (``replicate_below_numel``) gather their updated
        chunks now (one all_gather each, started together), so a read or an in-place edit between
        steps sees the current weights; the others are gathered by the next forward."""
        self.lifecycle.mark_stale()
        kept = [u for u in self.units if u.persistent]
        for unit in kept:
            unit.unshard(async_op=True)
        for unit in kept:
            unit.drop_prefetch()  # waits for its gather

    def _after_load(self) -> None:
        self.synchronize_parameters()

    def _master_chunks(self) -> list[MasterChunk]:
        self._finish_gathers()  # a gather in flight: its parameters' values are being written
        return [(u.space, u.master, u.is_unsharded) for u in self.units]

    def _attached_data(self) -> list[AttachedData]:
        return self._attached

    def _finish_gathers(self) -> None:
        for unit in self.units:
            unit.drop_prefetch()

    def _summonable(self) -> list[Summonable]:
        """Each unit's space; a unit gathered now (``persistent``, or not resharded after its
        forward) also takes what is written back into its gathered copy."""
        # (PRE_BACKWARD outside a backward: left so by a no_sync backward that ended before it)
        busy = [u for u in self.units if u.state is TrainingState.FORWARD]
        if busy or in_backward():
            where = (f"unit '{self._module_name(busy[0].module)}' ran its forward" if busy
                     else "a backward ran")
            raise ConfigError(
                f"{type(self).__name__}: summon_full_parameters() was entered while {where}; enter "
                "it outside forward and backward (between steps, or after backward)")
        for unit in self.units:
            unit.drop_prefetch()
        return [Summonable(u.space, u.master, u.full if u.is_unsharded else None) for u in self.units]

    def _masters_written(self) -> None:
        """Refuses edits while a forward with grad awaits the end of its step's backward (a
        no_sync backward leaves it open): that backward would gather the edited weights for a
        forward computed with the old ones."""
        if self.lifecycle.awaiting_backward():
            raise ConfigError(
                f"{type(self).__name__}: the weights were edited in summon_full_parameters() after a "
                "forward with grad whose step's backward has not ended (no_sync leaves it open until "
                "the synchronising backward), which would gather the edited ones; edit them between "
                "steps (reading alone is fine: nothing is written back)")
        self.lifecycle.mark_stale()

    def _zero_grad(self) -> None:
        """Gradients accumulated under no_sync wait on the units' parameters, not the masters:
        they are cleared too, or the next synchronisation would reduce them with its own."""
        for unit in self.units:
            for param in unit.params:
                param.grad = None
            unit.accumulated = None
            unit.ready.clear()

    def local_parameter_shard(self) -> list[torch.Tensor]:
        return [u.master for u in self.units]

    def shard_layout(self) -> ShardLayout:
        return ShardLayout([u.master for u in self.units],
                           [u.space.segments(self.backend.rank) for u in self.units])

    def _gather_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(unit.gather_full())
        frozen = {n: p.detach().clone() for n, p in self.wrapped_model.named_parameters()
                  if not p.requires_grad}
        out.update(frozen)
        return out  # a shared parameter under its first name: gather_full_parameters adds the others

    def _strategy_buffers(self) -> list[torch.Tensor]:
        return [t for u in self.units for t in (u.full, u.accumulated) if t is not None]

    def largest_unit_bytes(self) -> int:
        """Bytes of the largest gathered unit (the transient peak above the shards)."""
        return max((u.full_bytes for u in self.units), default=0)


def refuse_sparse_gradients(module: nn.Module, strategy: str) -> None:
    """ConfigError for an embedding that makes sparse gradients: a unit reduce-scatters one flat
    dense gradient (as FSDP does, which does not take them either)."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ConfigError(
                f"{strategy}: '{name}' ({type(sub).__name__}) has sparse=True, but its units reduce "
                "one flat dense gradient; build it with sparse=False, or use DDPModel or "
                "ZeRO1Model/ZeRO2Model, which take sparse gradients (densified in their buckets)")


# Containers whose forward never runs: their hooks would never gather a unit rooted there.
NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)


def parameter_homes(module: nn.Module) -> dict[int, str]:
    """For every parameter (by id), the qualified name of the module whose unit must hold it:
    the lowest common ancestor of every place it is registered (see [Note: shared
    parameters]), moved up past containers that are never called ("" is ``module`` itself)."""
    places: dict[int, list[list[str]]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for _, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            places.setdefault(id(p), []).append(prefix.split(".") if prefix else [])
    homes = {}
    for key, paths in places.items():
        common = paths[0]
        for path in paths[1:]:
            length = 0
            while length < min(len(common), len(path)) and common[length] == path[length]:
                length += 1
            common = common[:length]
        while common and isinstance(module.get_submodule(".".join(common)), NEVER_CALLED):
            common = common[:-1]
        homes[key] = ".".join(common)
    return homes


def is_within(name: str, prefix: str) -> bool:
    """Whether the module named ``name`` is the module named ``prefix`` or inside it."""
    return not prefix or name == prefix or name.startswith(prefix + ".")


def check_units_cover(units: list[UnitSpec], module: nn.Module, strategy: str) -> None:
    """ConfigError unless every trainable parameter is in exactly one unit."""
    seen: dict[int, str] = {}
    for _, params in units:
        for name, p in params:
            if id(p) in seen:
                raise ConfigError(f"{strategy}: parameter {name!r} is in two units (also as "
                                  f"{seen[id(p)]!r}); put modules sharing it in one unit")
            seen[id(p)] = name
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            raise ConfigError(f"{strategy}: parameter {name!r} is in no unit")
