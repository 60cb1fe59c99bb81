"""HybridShardedModel: tensor parallelism inside pipeline stages inside data parallelism, with
optional context (sequence) parallelism (``cp``; see ``context_parallel``).

Construction (collective on the world backend): ShardedModelBase's structure check and broadcast
of rank 0's dense model; ``ParallelDims.build_groups``; the model is cut into ``pp`` stages
(balanced by parameter count, or at ``split_points``) and this rank keeps stage ``pp_index``;
the tensor-parallel plan is applied to that stage only (tensor group ``tp``); parameters tied
across stages (the LM's embedding and head) get a subgroup of the stages holding them.

Each rank holds this stage's parameters, split ``1/tp`` where the plan splits them, replicated over
the ``dp`` ranks of its data-parallel group. A step (``train_step``) runs the pipeline schedule over
``num_microbatches`` (p2p over the pipeline group; the loss is broadcast from the last stage), then
``synchronize_gradients``: one all_reduce(SUM) per tied-weight group across its stages, then over
the data-parallel group one all_reduce(AVG) per dtype of the flat gradients
(``data_parallel="ddp"``, plain torch.optim optimizer) or ZeRO-1/2's reduce_scatter into a ``1/dp``
master chunk (``"zero1"``/``"zero2"``: ZeRO1Optimizer/ZeRO2Optimizer(model, cls), whose step
all-gathers the updated chunks; see ``hybrid_zero``); then the optimizer steps and one
all_reduce(AVG) of the loss over the world gives the global mean loss. With ``pp == 1`` there is no
schedule: one forward and backward of the slice, and ``model(x)`` is differentiable (without cp); a
backward after ``synchronize_gradients`` (a second one over that forward, ``retain_graph=True``)
adds its gradients, synchronised by the next call, to the synchronised ones, as one process sums
them. With ``cp > 1`` each rank also keeps only its slice of every sequence, attention runs as a
ring over the cp group, and what is said of the dp group above (gradient averaging, ZeRO's shards,
the loss's mean, checkpoint writers) holds for the replica group of ``dp * cp`` ranks instead.
Dropout with ``tp > 1``: every ``nn.Dropout`` of the stage draws from a generator seeded alike
across the tensor group (so replicated activations and parameters stay bitwise equal there) and
differently per replica and stage; the head-split attention dropout draws per tensor rank. The seed
is ``dropout_seed``, or world rank 0's ``torch.initial_seed()``, agreed by one broadcast at
construction (``tensor_parallel_rng``); with tp 1, a given seed seeds each rank's own (``rank_dropout``)."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.compile_support import refuse_on_threads
from distframe.errors import ConfigError
from distframe.mesh import ParallelDims
from distframe.models.base import ShardedModelBase
from distframe.models.inputs import call_with, train_batch
from distframe.models.config import ShardingConfig
from distframe.models.context_parallel import (apply_context_parallel, batch_slices, gather_output,
                                               input_slices, sequence_slice)
from distframe.models.devices import module_device
from distframe.models.dp_modules import prepare_replicated_modules
from distframe.models.hybrid_checks import check_arguments, check_find_unused, check_not_dense
from distframe.models.hybrid_stages import (apply_stage_tensor_parallel, build_chunks, cross_rank_buffers,
                                            stage_layers, stage_ranges)
from distframe.models.hybrid_zero import ZeroShards
from distframe.models.hybrid_state import (LocalParameter, ParameterCatalog, WrittenOnceLayout,
                                           all_reduce_grads, gather_full, owns_piece, shard_layout,
                                           zero_counted_segments)
from distframe.models.tensor_group_batch import global_mean_loss
from distframe.models.parameter_usage import ParameterUsage
from distframe.models.pipeline_comm import broadcast_any
from distframe.models.pipeline_outputs import refuse_backward
from distframe.models.pipeline_runtime import PipelineRunner
from distframe.models.rank_dropout import stage_dropout_rng
from distframe.models.replicas import mark_wrapped
from distframe.models.sharded_state import RangeReader, ShardLayout, check_replicated, fill_shards, piece_key
from distframe.models.tensor_parallel_mixing import wiring_checks
from distframe.models.tensor_parallel_plan import split_dims
from distframe.models.tied_gradients import TiedGradients
from distframe.models.wrapped_parameters import WrappedParameters
from distframe.precision import refuse_policy


class HybridShardedModel(ShardedModelBase):
    """``dp x tp x pp`` training of one model (see the module docstring for what runs when)."""

    accepts_plain_optimizer = True
    skips_unused_parameters = True  # False on an instance with ZeRO (check_find_unused)
    skipping_alternative = "data_parallel='ddp'"

    def __init__(self, model: nn.Module | Sequence[nn.Module], backend: ICommunicationBackend, *,
                 dims: ParallelDims, tp_plan: Mapping[str, str] | None = None, num_microbatches: int = 1,
                 schedule: str = "1f1b", data_parallel: str = "ddp",
                 split_points: Sequence[int] | None = None, virtual_stages: int = 1,
                 config: ShardingConfig | None = None, dropout_seed: int | None = None,
                 **settings: Any) -> None:
        model = nn.Sequential(*model) if isinstance(model, (list, tuple)) else model
        check_arguments(dims, backend, num_microbatches, schedule, data_parallel, virtual_stages)
        super().__init__(model, backend, config=config, **settings)
        check_find_unused(self.config.find_unused_parameters, data_parallel)
        self.dims, self.num_microbatches, self.schedule = dims, num_microbatches, schedule
        self.virtual_stages, self.data_parallel = virtual_stages, data_parallel
        self.skips_unused_parameters = data_parallel == "ddp"  # ZeRO steps a flat master chunk
        self.groups = dims.build_groups(backend)
        self._device = module_device(model)
        dense_params = list(model.parameters())  # keeps ids stable while mapping names below
        dense_names = {id(p): n for n, p in model.named_parameters()}
        dense_buffers = {id(b): n for n, b in model.named_buffers()}
        ranges = stage_ranges(model, dims, virtual_stages, split_points)
        every_stage = stage_layers(model, ranges, dims.pp, virtual_stages)
        self.catalog = ParameterCatalog(model, every_stage)
        prepare_replicated_modules(self, model, self.groups.replicas)  # SyncBatchNorm, max_norm: dp_modules
        mark_wrapped(model, type(self).__name__)  # the model changes from here (layers split, stages kept)
        origins: dict[int, int] = {}
        self.dropout_rng = stage_dropout_rng(model, every_stage[self.groups.pp_index], dropout_seed, dims,
                                             backend, self.groups, self._device)
        if dims.tp_enabled:
            origins = apply_stage_tensor_parallel(model, tp_plan, every_stage[self.groups.pp_index],
                                                  self.groups.tp, self.dropout_rng)
        chunks = build_chunks(model, ranges, dims.pp, self.groups.pp_index, virtual_stages)
        # See [Note: a split output that no row takes] in tensor_parallel_flow.py: the model's
        # output, the last stage's (a split activation may cross to the stage of its row).
        last = chunks if ranges is None else [c for c in chunks if c.index == c.num_stages - 1]
        self._tp_checks = wiring_checks(chunks, last) if dims.tp_enabled else ()
        stage = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        if dims.cp_enabled:
            apply_context_parallel([model, stage], self.groups.cp)
        splits = split_dims(stage)
        self.local_parameters = [
            LocalParameter(dense_names[origins.get(id(p), id(p))], p, splits.get(id(p)))
            for p in stage.parameters()]
        self.local_buffers = {dense_buffers[id(b)]: b for b in stage.buffers()}
        # Dense weights the plan replaced by slices: an optimizer built before wrapping holds them.
        replaced = set(origins.values()) - {id(lp.param) for lp in self.local_parameters}
        self._replaced_dense = {id(p): (weakref.ref(p), dense_names[id(p)]) for p in dense_params
                                if id(p) in replaced}
        del dense_params
        self.wrapped_model, self._call = stage, (stage,)  # not the dense model: it kept all stages alive
        self.tied_gradients = TiedGradients.for_stages(self.catalog.shared_across_stages(),
                                                       self.local_parameters, self.groups.pp)
        self.accepts_plain_optimizer = data_parallel == "ddp"
        self.optimizer_name = {"zero1": "ZeRO1Optimizer", "zero2": "ZeRO2Optimizer"}.get(
            data_parallel, "a torch.optim optimizer")
        self.zero = None if data_parallel == "ddp" else ZeroShards(
            self._trainable(), self.groups.replicas, stage=int(data_parallel[-1]), device=self._device,
            bucket_cap_bytes=self.config.bucket_cap_bytes)  # the most one round moves (hybrid_zero.py)
        self._gradients_synchronized = False
        self._usage: ParameterUsage | None = None  # built at the first synchronisation that needs it
        # What this stage trains, fixed here (ZeRO's shards, the gradient hooks): checked per step.
        self._wrapped_parameters = WrappedParameters(stage, None, [lp.name for lp in self.local_parameters])
        self._gradient_hooks = [p.register_hook(self._on_gradient) for p in self._trainable()]
        shared = cross_rank_buffers(every_stage, self.groups.pp_index, dense_buffers)  # none without pp
        self.runner = (PipelineRunner(chunks, self.groups.pp, num_microbatches=num_microbatches,
                                      schedule=schedule, dense=model, shared_buffers=shared)
                       if dims.pp_enabled else None)

    # ---- forward and the step ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Without pipelining, the (tensor-parallel) model's forward; with cp, of this rank's slice
        of each argument along the sequence, the slices' outputs gathered. With pipelining: every
        micro-batch forward without autograd, the last stage's output broadcast over the pipeline
        group. A broadcast or gathered output's backward raises ConfigError: train with train_step."""
        refuse_on_threads(self.wrapped_model, self.backend)  # [Note: compiled code on in-memory ranks]
        cp = self.groups.cp
        self._replica_buffers.take_arrived()  # see [Note: buffers after a step]
        if self.runner is None and torch.is_grad_enabled():  # a backward through it may follow
            self._before_backward()
        if self.runner is None and cp is None:
            return self.wrapped_model(*args, **kwargs)
        if self.runner is None:  # context parallel: each argument along the sequence sliced
            sliced = input_slices({**dict(enumerate(args)), **kwargs}, cp)
            output = self.wrapped_model(*[sliced.pop(i) for i in range(len(args))], **sliced)  # pops first
        elif len(args) != 1 or kwargs:
            raise ConfigError("a pipelined model takes one input tensor")
        else:
            inputs = args[0] if cp is None else sequence_slice(args[0], cp, "inputs")
            output = broadcast_any(self.runner.forward_only(inputs), self.groups.pp, self.dims.pp - 1,
                                   self._device)
        # Gathered or broadcast outside autograd: a backward through it must go to train_step.
        return refuse_backward(output if cp is None else gather_output(output, cp))

    def forward_backward(self, batch: tuple[Any, Any], loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of this rank's slice, gradients left in ``.grad`` unsynchronised;
        returns the mean loss over the slice (the same on every rank of the pipeline group)."""
        refuse_on_threads(self.wrapped_model, self.backend)  # [Note: compiled code on in-memory ranks]
        inputs, targets = self._sequence_slices(*train_batch(batch))
        self._before_backward()
        if self.runner is None:
            loss = loss_fn(call_with(self.wrapped_model, inputs), targets)
            loss.backward()
            return loss.detach()
        loss = self.runner.forward_backward(inputs, targets, loss_fn)
        if loss is None:
            loss = torch.zeros((), dtype=torch.float64, device=self._device)
        loss = loss.detach().to(torch.float64).reshape(1).clone()
        self.groups.pp.broadcast(loss, self.dims.pp - 1)
        return loss.reshape(())

    def _before_backward(self) -> None:
        self._wrapped_parameters.check(self)
        self._replica_buffers.before_forward(self._synchronize, self.wrapped_model.training)
        self._reopen_gradients()

    def _reopen_gradients(self) -> None:
        """The next ``synchronize_gradients`` communicates again: what a backward adds to the
        gradients already synchronised (no zero_grad between) is synchronised and added to them,
        as one process would sum them. Runs before a differentiable forward and, through
        ``_on_gradient``, before the first gradient of a backward that follows a synchronisation
        without one (a second backward over a forward, ``retain_graph=True``)."""
        if self.zero is not None:
            self.zero.restart_accumulation()
        if self._gradients_synchronized:
            self.tied_gradients.set_aside()
        self._gradients_synchronized = False

    def _on_gradient(self, grad: torch.Tensor) -> None:
        # A tensor hook on a parameter runs before its gradient is accumulated into .grad, so
        # the first one of a backward sees every .grad as the synchronisation left it. No
        # communication here: a backward may reach different parameters on different ranks.
        if self._gradients_synchronized:
            self._reopen_gradients()

    def validation_loss(self, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` without autograd, the same on every rank of the
        pipeline group: with pipelining only the scalar is broadcast from the last stage."""
        inputs, targets = self._sequence_slices(inputs, targets)
        self._replica_buffers.take_arrived()
        with torch.no_grad():
            if self.runner is None:
                loss = loss_fn(call_with(self.wrapped_model, inputs), targets).detach()
            else:
                output = self.runner.forward_only(inputs)
                loss = torch.zeros(1, dtype=torch.float64, device=self._device)
                if output is not None:
                    loss[0] = float(loss_fn(output, targets))
                self.groups.pp.broadcast(loss, self.dims.pp - 1)
                loss = loss.reshape(())
            if self.groups.cp is not None:  # each slice's mean over equal slices: their mean
                loss = loss.reshape(1).clone()
                self.groups.cp.all_reduce(loss, ReduceOp.AVG)
                loss = loss.reshape(())
            return loss

    def _sequence_slices(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        return batch_slices(inputs, targets, self.groups.cp)

    def data_parallel_coordinates(self) -> tuple[int, int]:
        """``(dp, dp_index)``: which slice of the global batch this rank trains on."""
        return self.dims.dp, self.groups.dp_index

    def parameter_metadata(self) -> dict[str, dict[str, Any]]:
        """The unsplit model's parameters, for checkpoint metadata (``ParameterCatalog.metadata``)."""
        return self.catalog.metadata()

    def _buffer_replicas(self) -> tuple[list[torch.Tensor], ICommunicationBackend]:
        return list(self.local_buffers.values()), self.groups.replicas  # this stage's, over dp x cp

    def replicated_names(self) -> set[str]:
        return {e.name for e in self.catalog.buffers}

    def _state_names(self) -> list[tuple[str, str]]:
        return self.catalog.state_keys

    def replicated_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's persistent buffers under their names in the unsplit model."""
        return [(n, b) for n, b in self.local_buffers.items() if n not in self.catalog.non_persistent]

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable, optimizer: Any, *,
                   max_grad_norm: float | None = None, accumulation_steps: int = 1) -> float:
        self.check_optimizer(optimizer)
        if not hasattr(optimizer, "wrapped_optimizer"):  # a plain torch.optim optimizer
            check_not_dense(optimizer, self._replaced_dense)
        return super().train_step(batch, loss_fn, optimizer, max_grad_norm=max_grad_norm,
                                  accumulation_steps=accumulation_steps)

    def _global_mean_loss(self, loss: torch.Tensor) -> float:
        # One all_reduce over the replica group (none when dp*cp == 1); with tp > 1 first one all_gather
        # over the tensor group: its ranks must be given one batch ([Note: one batch per tensor group]).
        return global_mean_loss(loss, self.groups)

    # ---- ShardedModelBase ----------------------------------------------------------------------
    def _check_config(self, config: ShardingConfig) -> None:
        refuse_policy(config.mixed_precision, type(self).__name__)  # it has no master weights to keep

    def _parameters_list(self) -> list[torch.Tensor]:
        return [lp.param for lp in self.local_parameters]

    def dense_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name in the unwrapped model, this rank's parameter or slice) of each parameter it
        holds: the names shard layouts and checkpoints use (the stage modules' own differ)."""
        return [(lp.name, lp.param) for lp in self.local_parameters]

    def _trainable(self) -> list[torch.Tensor]:
        # Frozen parameters get no gradient (torch.optim skips them), so no communication either.
        return [lp.param for lp in self.local_parameters if lp.param.requires_grad]

    def local_parameter_shard(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: this rank's parameters, or with ZeRO its master chunk."""
        return self._parameters_list() if self.zero is None else [self.zero.master]

    def synchronize_gradients(self) -> None:
        """Tied weights: all_reduce(SUM) across their stages; then over dp (x cp): all_reduce(AVG) (ddp),
        or ZeRO's reduce_scatter into the master chunk, which takes in-place edits first (local, each call).
        Once per backward: further calls before the next backward (or forward_backward) do nothing."""
        if self.zero is not None:  # see hybrid_zero's docstring: before the optimizer steps the masters
            self.zero.take_in_place_edits()
        if self._gradients_synchronized or not self._synchronize:
            return
        keep_unused = self.config.find_unused_parameters
        if not keep_unused and (self.zero is not None or self.groups.replicas.world_size > 1):
            self._warn_unused()
        self.tied_gradients.all_reduce(keep_unused)
        if self.zero is not None:
            self.zero.reduce_gradients()
        elif self.groups.replicas.world_size > 1:
            all_reduce_grads(self._trainable(), self.groups.replicas, ReduceOp.AVG, keep_unused)
        self._replica_buffers.after_step()
        self._gradients_synchronized = True

    def _warn_unused(self) -> None:
        """Once per rank: a trainable parameter without a gradient, which data parallelism is
        about to average as zeros (see ParameterUsage)."""
        if self._usage is None:
            trainable = [lp for lp in self.local_parameters if lp.param.requires_grad]
            self._usage = self._parameter_usage([lp.name for lp in trainable], [lp.param for lp in trainable])
        self._usage.warn_unless_every_gradient_is_held()

    def before_plain_step(self) -> None:
        # A hand-written loop (loss.backward(); opt.step()) synchronises nothing by itself.
        self.synchronize_gradients()

    def synchronize_parameters(self) -> None:
        """With ZeRO: all_gather of the updated master chunks into the parameters (dp group)."""
        if self.zero is not None:
            self.zero.gather_parameters()

    def _zero_grad(self) -> None:
        # With ddp ShardedModelBase.zero_grad cleared the parameters (zeros kept for
        # set_to_none=False, as one process does); ZeRO's hold what its master was reduced from.
        if self.zero is not None:
            for lp in self.local_parameters:
                lp.param.grad = None
        self.tied_gradients.forget()

    def _read_layout(self) -> ShardLayout:
        return shard_layout(self.local_parameters, self.catalog, self.groups.tp_index, self.dims.tp)

    def shard_layout(self) -> ShardLayout:
        """Dense ranges of ``local_parameter_shard()`` (what optimizer state is keyed by)."""
        layout = self._read_layout()
        # Frozen parameters have no optimizer state (and no place in ZeRO's chunk).
        trainable = [i for i, lp in enumerate(self.local_parameters) if lp.param.requires_grad]
        segments = [layout.segments[i] for i in trainable]
        if self.zero is not None:
            chunk = self.zero.layout(segments)
            written = zero_counted_segments(chunk, self.local_parameters, self.catalog, self.groups)
            return WrittenOnceLayout(chunk.shards, chunk.segments, written=written)
        lps = [self.local_parameters[i] for i in trainable]
        writes = [owns_piece(lp.split_dim, self.catalog.by_name[lp.name], self.groups) for lp in lps]
        return WrittenOnceLayout([lp.param for lp in lps], segments,
                                 written=[segs if write else [] for segs, write in zip(segments, writes)])

    def _gather_parameters(self) -> dict[str, torch.Tensor]:
        full = self.gather_full_parameters()
        return {e.name: full[e.name] for e in self.catalog.params}

    def gather_full_parameters(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict on every rank. Collective: all_gather of each split
        parameter over the tensor group, one broadcast per stage and dtype over the pipeline group
        (buffers are data-parallel replica 0's unless ``config.broadcast_buffers`` is False)."""
        self._replica_buffers.broadcast()  # rank 0's buffers (config.broadcast_buffers); collective
        return gather_full(self.local_parameters, self.local_buffers, self.catalog, self.groups)

    def _summonable(self) -> list:
        raise ConfigError(
            f"{type(self).__name__} holds a part of the model on each rank (its stage, its tensor "
            "split), which summon_full_parameters() cannot make whole in place; read the dense "
            "model's values from gather_full_parameters()")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """``param/<name>@<offset>`` pieces of the dense parameters (each range written by one rank
        of the world: data-parallel index 0, tensor index 0 for replicated parameters, the first
        stage holding a tied weight) and ``buffer/<name>``. Merge every rank's dict for the model.
        A holder's ``state_dict()`` is refused, as the base class refuses it."""
        self._refuse_nested_state_dict(args, kwargs)
        layout = self._read_layout()
        state: dict[str, torch.Tensor] = {}
        for lp, segments in zip(self.local_parameters, layout.segments):
            if not owns_piece(lp.split_dim, self.catalog.by_name[lp.name], self.groups):
                continue
            flat = lp.param.detach().reshape(-1)
            for s in segments:
                state[piece_key("param", s.name, s.param_offset)] = flat[s.shard_offset:s.shard_offset + s.length].clone()
        for name, buf in self.replicated_tensors():
            if owns_piece(None, self.catalog.by_name[name], self.groups):
                state[f"buffer/{name}"] = buf.detach().clone()
        return state

    def read_shards(self, reader: RangeReader) -> None:
        """Reads this rank's ranges from pieces of any layout (merged ``state_dict()`` outputs of
        any strategy, or a checkpoint reader); ``load_state_dict`` is this alone, no communication."""
        check_replicated(reader, self.replicated_tensors())
        layout = self._read_layout()
        fill_shards(layout, reader, "param", layout.shards)
        with torch.no_grad():
            for name, buf in self.replicated_tensors():
                buf.copy_(reader.replicated(name, buf.shape))
        if self.zero is not None:
            self.zero.refresh_master()
