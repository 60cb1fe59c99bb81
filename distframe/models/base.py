"""ShardedModelBase: the life cycle every strategy shares (construction, forward, train_step,
no_sync, sharded state, memory accounting); strategies supply where state lives and when to
communicate."""
from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.compile_support import refuse_on_threads, uncompiled
from distframe.errors import ConfigError
from distframe.models.accumulation import accumulated_backward
from distframe.models.casts import copy_refused, refuse_new_storage
from distframe.models.config import ShardingConfig, TrainingState, resolve_config
from distframe.models.devices import accelerator_of, inputs_on
from distframe.models.direct_calls import DirectCalls
from distframe.models.extra_state import copy_replicated
from distframe.models.flat import Segment
from distframe.models.full_parameters import Summonable, full_state_dict, refuse_while_summoned, summoned
from distframe.models.grad_norm import clip_sharded_grad_norm
from distframe.models.inputs import call_with, train_batch
from distframe.models.memory import storage_footprint
from distframe.models.parameter_usage import ParameterUsage
from distframe.models.plain_optimizer_guard import guard, refuse_in_train_step
from distframe.models.replica_buffers import ReplicaBuffers
from distframe.models.replicas import (broadcast_module_state, check_initialised, check_same_structure,
                                      check_unwrapped)
from distframe.models.sharded_state import (RangeReader, ShardLayout, check_replicated, current_pieces,
                                            fill_shards, replicated_state, replicated_state_names,
                                            shard_pieces, state_names, trainable_metadata)
from distframe.models.state_checks import incompatible_keys, loading_reader, refuse_nested_state_dict
from distframe.models.wrapped_parameters import WrappedParameters, parameter_usage
from distframe.models.zero_grad_route import route_submodule_zero_grad, route_zero_grad


class ShardedModelBase(nn.Module, abc.ABC):
    """Wraps ``module`` (never rewritten: hooks only) for data-parallel training over ``backend``.

    Construction (collective): when ``config.check_structure``, two small all_gathers compare
    parameter and buffer names, shapes and dtypes across ranks (ConfigError naming the first
    difference and the ranks); then one broadcast per dtype copies rank 0's parameters and
    buffers to every rank. Settings come from ``config`` (a ShardingConfig) or keywords.

    ``train_step(batch, loss_fn, optimizer)`` runs forward and backward on this rank's slice,
    gradient synchronisation, ``optimizer.step()``, ``optimizer.zero_grad()`` and one all_reduce
    of the loss; it returns the global mean loss, the same float on every rank.
    """

    #: Whether a plain ``torch.optim`` optimizer over ``parameters()`` trains this strategy.
    accepts_plain_optimizer = False
    #: The ShardedOptimizerBase subclass that belongs with this model (set by the optimizers).
    optimizer_name = "a ShardedOptimizer"
    #: Whether ``find_unused_parameters`` can leave a parameter's gradient None (DDP: the
    #: optimizer sees each parameter; flat shards mix them, so one range cannot be skipped).
    skips_unused_parameters = False
    skipping_alternative = "DDPModel"  #: where it does not: what the unused-parameter warning offers
    #: Whether every rank's ``local_parameter_shard()`` holds the same gradients once they are
    #: synchronised (DDP): a GradScaler's per-rank inf check then agrees without communication.
    replicates_gradients = False
    _direct_calls = DirectCalls()  # refuses nothing; ZeRO's and the unit models' refuse (direct_calls.py)

    def __init__(self, module: nn.Module, backend: ICommunicationBackend, *,
                 config: ShardingConfig | None = None, **settings: Any) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{type(self).__name__} wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(backend, ICommunicationBackend):
            raise ConfigError(f"backend must implement ICommunicationBackend (for example the one "
                              f"spawn() passes to your function), got {type(backend).__name__}")
        check_unwrapped(module, type(self).__name__)
        check_initialised(module, type(self).__name__)
        self._call = (module,)  # called as given (a tuple: not registered as a submodule again)
        self._input_device = accelerator_of(module)  # CPU inputs go there, as DDP and FSDP2 move them
        module = self.wrapped_model = uncompiled(module)
        self.backend, self.config = backend, resolve_config(config, settings)
        self._check_config(self.config)
        if self.config.find_unused_parameters and not self.skips_unused_parameters:
            raise ConfigError(
                f"find_unused_parameters applies to DDPModel: {type(self).__name__}'s optimizer "
                "updates flat shards that mix parameters, so it cannot skip one that no rank used "
                "(its gradient is zero, as in FSDP1 and DeepSpeed); use DDPModel for that")
        if self.config.check_structure:
            check_same_structure(module, backend)
        broadcast_module_state(module, backend)
        # Which parameters the strategy trains, and in which dtype, is decided now (buckets, shards).
        self._wrapped_parameters = WrappedParameters(module, self.config.mixed_precision)
        route_zero_grad(module, self)  # net.zero_grad() clears the shards: zero_grad_route.py
        route_submodule_zero_grad(module, self)
        self._synchronize, self.training_state = True, TrainingState.IDLE
        self._replica_buffers = ReplicaBuffers(self._buffer_replicas, self.config.broadcast_buffers)
        self._optimizer: Any = None
        guard(self)  # a plain optimizer over parameters its strategy shards is refused at step

    def _parameter_usage(self, names: list[str], params: list[nn.Parameter]) -> ParameterUsage:
        """What a strategy's gradient buckets record and do about parameters without a gradient."""
        return parameter_usage(self, names, params)

    @property
    def module(self) -> nn.Module:
        """``wrapped_model`` under torch DDP's (and DeepSpeed's) name, for code that reaches the
        model through ``.module``: this rank's part of it under model parallelism."""
        return self.wrapped_model

    # ---- what each strategy supplies ---------------------------------------------------------
    def _check_config(self, config: ShardingConfig) -> None:
        """Raises ConfigError for settings this strategy cannot honour."""

    @abc.abstractmethod
    def local_parameter_shard(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer updates (each a leaf with ``.grad`` after sync)."""

    @abc.abstractmethod
    def synchronize_gradients(self) -> None:
        """Completes this step's gradient communication; idempotent; collective."""

    def synchronize_parameters(self) -> None:
        """Makes parameters current after the optimizer updated the local shards; collective."""

    def before_plain_step(self) -> None:
        """Runs before a plain torch.optim optimizer steps this model's parameters (and before
        ShardedGradScaler's inf check of one): a model that takes plain optimizers and leaves its
        gradients unsynchronised after backward synchronises them here (plain_optimizer_guard)."""

    @abc.abstractmethod
    def shard_layout(self) -> ShardLayout:
        """Which parameter ranges ``local_parameter_shard()`` holds."""

    @abc.abstractmethod
    def _gather_parameters(self) -> dict[str, torch.Tensor]:
        """Full copies of every parameter of the wrapped model; collective."""

    def _pre_forward(self) -> None:
        """Runs before the wrapped model's forward."""

    def _post_forward(self, output: Any) -> Any:
        """Runs on the wrapped model's output; returns what ``forward`` returns."""
        return output

    def _after_load(self) -> None:
        """Runs after shards were overwritten by ``load_state_dict``; collective."""

    def _zero_grad(self) -> None:
        """Clears gradients this strategy holds beyond the optimizer's shards."""

    def _strategy_buffers(self) -> list[torch.Tensor]:
        """Communication buffers the strategy holds between steps (for memory_footprint)."""
        return []

    def _buffer_replicas(self) -> tuple[list[torch.Tensor], ICommunicationBackend]:
        """The buffers ``broadcast_buffers`` keeps as rank 0's (replica_buffers.py), and their group."""
        return list(self.wrapped_model.buffers()), self.backend

    # ---- shared life cycle -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_while_summoned(self, "forward ran")
        refuse_on_threads(self._call[0], self.backend)  # [Note: compiled code on in-memory ranks]
        if torch.is_grad_enabled():
            self._wrapped_parameters.check(self)
        self._pre_forward()  # may end a synchronisation first (a backward without a step)
        self._replica_buffers.before_forward(self._synchronize, self.wrapped_model.training)
        with self._direct_calls.calling():  # [Note: the wrapped module called directly]
            args, kwargs = inputs_on(self._input_device, (args, kwargs))
            return self._post_forward(self._call[0](*args, **kwargs))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without communicating; the first
        backward after it synchronises the accumulated sum (averaged across ranks). Under a
        MixedPrecisionPolicy whose reduce_dtype is finer than param_dtype the sum is kept in
        reduce_dtype, off the parameters' ``.grad`` (zeros or None meanwhile), as FSDP2 keeps it."""
        previous, self._synchronize = self._synchronize, False
        try:
            yield
        finally:
            self._synchronize = previous

    @contextlib.contextmanager
    def summon_full_parameters(self, *, writeback: bool = True) -> Iterator[None]:
        """Inside, every parameter of the wrapped model is whole, at master precision (float32
        under a MixedPrecisionPolicy; frozen ones as held), as ``gather_full_parameters()``; with
        ``writeback``, on leaving, what this rank holds takes what was written (make the same edits
        on every rank); without it, or when the block raises, the edits are dropped. Entering is
        collective (one all_gather per flat space; none for DDP); leaving is not. No forward
        inside. A block that only reads writes nothing, so it may run between a forward and its
        backward too (ZeRO-3/FSDP: once the forward has ended). See full_parameters.py."""
        refuse_while_summoned(self, "summon_full_parameters() was entered again")
        spaces = self._summonable()
        sharded = {id(p) for s in spaces for p in s.space.params}
        whole = [p for p in self.wrapped_model.parameters() if id(p) not in sharded]
        self._summoned = True
        try:
            with summoned(spaces, whole, self.backend, writeback=writeback, writing=self._masters_written):
                yield
        finally:
            self._summoned = False

    def _summonable(self) -> list[Summonable]:
        """The flat spaces whose master chunks this rank holds; none where parameters are whole."""
        return []

    def _masters_written(self) -> None:
        """Runs as summon_full_parameters writes the masters back: may refuse it (ConfigError); local."""

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer: Any, *, max_grad_norm: float | None = None,
                   accumulation_steps: int = 1) -> float:
        """One optimisation step on this rank's slice; returns the global mean loss.
        ``max_grad_norm``: clip gradients by the whole model's norm first (``clip_grad_norm_``).
        ``accumulation_steps``: run the slice in that many equal pieces, one at a time (see
        accumulation.py): the same step, with one piece's activations alive at a time."""
        self.check_optimizer(optimizer, stepping=True)
        loss = accumulated_backward(self, batch, loss_fn, accumulation_steps)
        self.synchronize_gradients()
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        return self._global_mean_loss(loss)

    def forward_backward(self, batch: tuple[Any, Any], loss_fn: Callable) -> torch.Tensor:
        """Forward on ``batch = (inputs, targets)`` (a dict or tuple of inputs is unpacked into the
        call) and backward of ``loss_fn(output, targets)``; returns this rank's loss. Gradients are
        synchronised as the strategy does during backward; no step is taken."""
        inputs, targets = train_batch(batch)
        output = call_with(self, inputs)  # forward moves the inputs to a GPU model's device
        loss = loss_fn(output, inputs_on(self._input_device, targets))
        # Drop our reference to the output (for an LM, the logits: often the largest activation)
        # so backward can free it once the graph is done with it.
        del output
        loss.backward()
        return loss

    def _global_mean_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().to(torch.float64).reshape(1).clone()
        self.backend.all_reduce(total, ReduceOp.AVG)
        return float(total)

    def check_optimizer(self, optimizer: Any, *, stepping: bool = False) -> None:
        """ConfigError unless ``optimizer`` belongs with this model and, ``stepping``, can be stepped
        by train_step (``plain_optimizer_guard.refuse_in_train_step``)."""
        name, sharded = type(optimizer).__name__, hasattr(optimizer, "wrapped_optimizer")
        if sharded and getattr(optimizer, "model", None) is not self:
            raise ConfigError(f"{name} was built for a different model; build it as {name}(this_model, ...)")
        if stepping:
            refuse_in_train_step(optimizer)
        if not sharded and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a ShardedOptimizer, got {name}")
        if not sharded and not self.accepts_plain_optimizer:
            raise ConfigError(f"{type(self).__name__} shards optimizer state: wrap the optimizer as "
                              f"{self.optimizer_name}(model, torch.optim.{name}, **kwargs)")

    def attach_optimizer(self, optimizer: Any) -> None:
        """Called by ShardedOptimizerBase so memory_footprint can count optimizer state."""
        self._optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients. ``set_to_none=False`` keeps them as zeros, as torch does: a step
        without a backward in between still moves the parameters (weight decay, momentum, Adam's
        moments), and the next synchronisation adds to them. A zero gradient that is a chunk of
        ZeRO-1's kept bucket gets storage of its own there (its ``_zero_grad``)."""
        for shard in self.local_parameter_shard():
            if not set_to_none and shard.grad is not None:
                shard.grad.zero_()
            else:
                shard.grad = None
        self._zero_grad()
        cleared = getattr(self._optimizer, "gradients_cleared", None)
        if cleared is not None:  # what the optimizer derived from these gradients goes with them
            cleared()

    # ---- full and sharded state --------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Synchronises gradients, then clips them by the norm of the whole model's gradients,
        as ``torch.nn.utils.clip_grad_norm_`` on the unwrapped model would (each element counted
        once across ranks). Returns that norm (float64), the same on every rank; collective.
        Call it between backward and ``optimizer.step()``."""
        self.synchronize_gradients()
        layout = self.shard_layout()
        return clip_sharded_grad_norm(layout.shards, self._counted_segments(layout), self.backend,
                                      max_norm, norm_type)

    def _counted_segments(self, layout: ShardLayout) -> list[list[Segment]]:
        """The ranges of each local shard this rank adds to a global norm: one rank per range."""
        return layout.owned(self.backend.rank, self.backend.world_size)

    def gather_full_parameters(self) -> dict[str, torch.Tensor]:
        """The wrapped model's full state dict (parameters gathered, buffers copied), identical
        on every rank (buffers are rank 0's, broadcast now, unless ``config.broadcast_buffers`` is
        False); collective. It reads: a live buffer is written only where it differs from rank
        0's, so it may run between a forward and its backward."""
        self._replica_buffers.broadcast()  # rank 0's, where they differ (broadcast_tensors); collective
        return full_state_dict(self.wrapped_model, self._gather_parameters())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's share of the parameters (``param/<name>@<offset>`` 1-D pieces) and, on rank
        0, the buffers (``buffer/<name>``). Merge every rank's dict to get the whole model.
        ConfigError when a module holding this one asks (its own ``state_dict()``): a share has
        no place in that dict, and nothing else would have put the model there."""
        self._refuse_nested_state_dict(args, kwargs)
        layout = self.shard_layout()
        state = shard_pieces(layout, self.backend.rank, self.backend.world_size, "param", layout.shards)
        if self.backend.rank == 0:
            for name, tensor in self.replicated_tensors():
                state[f"buffer/{name}"] = tensor.detach().clone()
        return state

    def parameter_metadata(self) -> dict[str, dict[str, Any]]:
        """Name, full shape and stored dtype of every trainable parameter of the unwrapped model,
        the same on every rank: what a checkpoint records. Model-parallel strategies, whose
        ``wrapped_model`` holds only this rank's part, override it with the dense model's."""
        fallback = self.local_parameter_shard()[0].dtype
        return trainable_metadata(self.wrapped_model, self.shard_layout(), fallback)

    def replicated_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Persistent buffers, frozen parameters and extra state (extra_state.py): identical on
        every rank, saved once by rank 0 (non-persistent buffers are not, as torch leaves them out)."""
        return replicated_state(self.wrapped_model)

    def replicated_names(self) -> set[str]:
        """Every buffer and frozen-parameter name of the unwrapped model, the same on every rank
        (model-parallel strategies, whose ranks hold parts, override it with the dense model's);
        non-persistent buffers too, which a load ignores where an older checkpoint holds them."""
        return replicated_state_names(self.wrapped_model)

    def state_aliases(self) -> dict[str, str]:
        """Each further ``state_dict()`` name of a tensor the unwrapped model holds under several
        (tied weights), mapped to the name it is stored under; the same on every rank."""
        return {key: name for key, name in self._state_names() if key != name}

    def _state_names(self) -> list[tuple[str, str]]:
        """The unwrapped model's ``state_dict()`` keys in order, each with the name it is stored under."""
        return state_names(self.wrapped_model)

    def _refuse_nested_state_dict(self, args: tuple, kwargs: dict[str, Any]) -> None:
        refuse_nested_state_dict(type(self).__name__, args, kwargs)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor] | RangeReader, strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:  # noqa: ARG002
        """Loads pieces from any layout (merge the ranks' ``state_dict()`` outputs, or pass a
        checkpoint reader), or the unwrapped model's plain state dict (every key without a "/"),
        checked first (state_checks.py); each rank reads the ranges it holds (``read_shards``),
        then ``finish_load``. Collective. As torch's: ``strict=False`` leaves what the state lacks
        at its current values and ignores names the model lacks; returns ``(missing_keys,
        unexpected_keys)``, the unwrapped model's names."""
        replicated, aliases = self.replicated_names(), self.state_aliases()
        reader = loading_reader(state_dict, self.parameter_metadata(), replicated, aliases, strict=strict)
        keys = [key for key, _ in self._state_names()]
        missing, unexpected = incompatible_keys(state_dict, reader, keys, replicated, aliases)
        lacking = {aliases.get(k, k) for k in missing} - reader.stored_names()
        if lacking and not strict:  # what this rank holds of them now is read in their place
            held = current_pieces(self._read_layout(), self.replicated_tensors(), lacking)
            reader = reader.with_pieces(held)
        self.read_shards(reader)
        self.finish_load()
        return _IncompatibleKeys(missing, unexpected)

    def _read_layout(self) -> ShardLayout:
        """The parameter ranges ``read_shards`` fills on this rank."""
        return self.shard_layout()

    def read_shards(self, reader: RangeReader) -> None:
        """This rank's part of ``load_state_dict``: checks and reads the ranges and buffers it
        holds. No communication, so a rank whose read fails can tell its peers before any
        collective (``distframe.checkpoint.load``); every rank then calls ``finish_load``."""
        replicated = self.replicated_tensors()
        check_replicated(reader, replicated)
        layout = self._read_layout()
        fill_shards(layout, reader, "param", layout.shards)
        copy_replicated(self.wrapped_model, reader, replicated)

    def finish_load(self) -> None:
        """The collective end of a load, after ``read_shards`` on every rank (``_after_load``);
        tells the attached optimizer (an ElasticOptimizer commits what was loaded)."""
        self._after_load()
        loaded = getattr(self._optimizer, "model_loaded", None)
        if loaded is not None:
            loaded()

    # ---- conversions and copies (casts.py) ---------------------------------------------------
    def _apply(self, fn: Callable, recurse: bool = True) -> ShardedModelBase:
        if not self.accepts_plain_optimizer:  # .to(), .half(): refused where the strategy cannot follow
            refuse_new_storage(self, fn)
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy.deepcopy, copy.copy and pickle ask this
        raise copy_refused(self)

    # ---- memory ------------------------------------------------------------------------------
    def memory_footprint(self) -> dict[str, int]:
        """Bytes of distinct tensor storage this rank holds: parameters, gradients, optimizer
        state (its ShardedOptimizer's, or that of plain torch.optim ones that stepped it) and
        the strategy's buffers (each storage counted once, in that order)."""
        return storage_footprint(self)
