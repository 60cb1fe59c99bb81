"""Context (sequence) parallelism for HybridShardedModel: the ``cp`` axis of ``ParallelDims``.

The ``cp`` ranks of one replica split every sequence of their batch slice into ``cp`` equal
slices along dim 1 (rank ``cp_index`` keeps slice ``cp_index``). Token-wise layers (embeddings,
norms, MLPs, projections, the head and a token-wise loss) need nothing more; the position
embedding is told which slice it sees (``sequence_shard``); every ``DilatedAttention`` becomes a
``RingDilatedAttention`` over the cp group, which fetches the keys a slice attends to from the
ranks that hold them and sends their gradients back in backward. Each rank's loss is the mean over
its slice, so the model's loss is the mean over the cp group and its gradient the cp ranks'
average: gradients are averaged over the replica group (``dp * cp`` ranks), which HybridShardedModel
does in place of the dp group. That mean of the slices' means is the batch's mean only where
every slice counts as many tokens: a loss that skips some (``ignore_index`` on right-padded
labels, which gather on the last slices) is weighted otherwise than on one process, and a slice
whose every label is skipped gives ``F.cross_entropy``'s NaN (as a data-parallel rank does whose
every label is; torch DDP and torchtitan's context parallelism average alike). Pad with labels the
loss counts, or mask them into the loss with a weight that keeps each slice's token count.
Layers that mix tokens in other ways (``nn.MultiheadAttention``,
convolutions over time) are not converted: a model holding no ``DilatedAttention`` is refused.
With tensor parallelism as well, a rank's attention holds a slice of the heads
(``HeadShardedDilatedAttention``); it becomes a ring over the same heads, so each tp rank runs its
own ring over the cp ranks that hold its heads.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from attention.dilated import DilatedAttention
from attention.ring import RingDilatedAttention
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.replaced_modules import refuse_hooked
from distframe.models.pipeline_outputs import flatten_output, unflatten_output
from distframe.models.tensor_parallel_attention import HeadShardedDilatedAttention


def apply_context_parallel(modules: list[nn.Module], group: ICommunicationBackend) -> None:
    """Replaces every ``DilatedAttention`` under ``modules`` with a ring one over ``group`` (a
    ``RingDilatedAttention`` already there is moved onto ``group``) and points every
    ``sequence_shard`` at this rank's slice. ConfigError if there is no attention
    to convert or it uses attention dropout (the ring does not support it)."""
    seen: set[int] = set()
    converted = sharded = 0
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if hasattr(module, "sequence_shard"):
                module.sequence_shard = (group.rank, group.world_size)
                sharded += 1
            for name, child in module.named_children():
                if isinstance(child, RingDilatedAttention):
                    # A ring built over another group would span ranks that hold other
                    # sequences (or other replicas): it must run over this cp group.
                    child.backend = group
                    converted += 1
                elif type(child) in (DilatedAttention, HeadShardedDilatedAttention):
                    if child.attention_dropout:
                        raise ConfigError(f"cp > 1: {name} uses attention_dropout={child.attention_dropout}, "
                                          "which RingDilatedAttention does not support; set it to 0.0")
                    # A tensor-parallel rank's attention holds a slice of the heads: the ring
                    # keeps reading what those heads read in the dense module.
                    refuse_hooked(child, name, "context parallelism")  # [Note: hooks on replaced modules]
                    setattr(module, name, RingDilatedAttention(
                        child.segment_lengths, child.dilation_rates, child.softmax_scale, backend=group,
                        head_start=getattr(child, "head_start", 0), total_heads=getattr(child, "total_heads", None)))
                    converted += 1
    if converted == 0:
        raise ConfigError("cp > 1 splits each sequence across ranks, which needs the model's attention to "
                          "be DilatedAttention (it becomes RingDilatedAttention); this model has none: use cp=1")
    if sharded == 0:
        warnings.warn("cp > 1: no module of the model has a sequence_shard attribute, through which it "
                      "learns where its slice of each sequence starts; positions it makes from 0 "
                      "(torch.arange(T)) start again on every rank's slice. Give the module that makes "
                      "positions sequence_shard = (0, 1) (see attention.positions.shard_positions), or "
                      "ignore this if the model uses no positions", RuntimeWarning, stacklevel=3)


def batch_slices(inputs: Any, targets: Any, group: ICommunicationBackend | None) -> tuple[Any, Any]:
    """A batch's inputs and targets as this rank of ``group`` (None: no cp) trains on them."""
    if group is None:
        return inputs, targets
    return input_slices(inputs, group), sequence_slice(targets, group, "targets")


def input_slices(inputs: Any, group: ICommunicationBackend) -> Any:
    """``inputs`` (a tensor, or a dict, tuple or list of a model's arguments) with this rank's
    slice of every tensor that runs along the sequence: those of two or more dims whose dim 1 is
    the first such tensor's length (the tokens and their ``key_padding_mask``); anything else
    (flags, a per-sequence conditioning tensor) passes whole. Only a tensor could be given before,
    so a key padding mask could not reach the ring attention, which takes its slice."""
    if isinstance(inputs, torch.Tensor):
        return sequence_slice(inputs, group, "inputs")
    items = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) \
        if isinstance(inputs, (tuple, list)) else [inputs]
    length = next((t.shape[1] for t in items if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if length is None:
        return sequence_slice(inputs, group, "inputs")  # its error: no (batch, seq) tensor

    def cut(value: Any) -> Any:
        along = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length
        return sequence_slice(value, group, "inputs") if along else value
    if isinstance(inputs, dict):
        return {key: cut(value) for key, value in inputs.items()}
    return type(inputs)(cut(value) for value in inputs)


def sequence_slice(tensor: Any, group: ICommunicationBackend, what: str) -> Any:
    """Slice ``group.rank`` of ``group.world_size`` of ``tensor`` along dim 1 (the sequence)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        raise ConfigError(f"cp > 1 splits {what} along dim 1 (the sequence): pass (batch, seq, ...) "
                          f"tensors, got {type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tuple(tensor.shape)}")
    length, count = tensor.shape[1], group.world_size
    if length % count:
        raise ConfigError(f"cp={count} splits the sequence into equal slices, but {what} have length "
                          f"{length}; use a sequence length divisible by {count}")
    return tensor.narrow(1, group.rank * (length // count), length // count)


def gather_output(output: Any, group: ICommunicationBackend) -> Any:
    """The model's whole output from every rank's slice: each tensor of it (a tuple, list or dict
    of them too) gathered along dim 1, the sequence; ConfigError for one without that dim."""
    layout, leaves = flatten_output(output)
    for leaf in leaves:
        if leaf.dim() < 2:
            raise ConfigError(f"cp > 1 gathers the model's outputs along dim 1 (the sequence), but one "
                              f"has shape {tuple(leaf.shape)}; return (batch, seq, ...) tensors (a loss "
                              "of each slice belongs in loss_fn)")
    return unflatten_output(layout, iter([gather_sequence(t, group) for t in leaves]).__next__)


def gather_sequence(tensor: torch.Tensor, group: ICommunicationBackend) -> torch.Tensor:
    """The whole sequence from every rank's slice (dim 1), on every rank of ``group``."""
    gathered = group.all_gather(tensor.movedim(1, 0).contiguous())
    return gathered.movedim(0, 1)
