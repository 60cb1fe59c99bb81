"""Megatron tensor-parallel layers: the math of a split linear, embedding and layer norm.

Each layer is built from a dense module (``from_dense``), keeps this rank's slice of its weights
and reaches the other ranks of the tensor-parallel group only through the conjugate operators of
``distframe.backends.functional``:

* ``f`` = ``copy_to_parallel_region``: identity forward, all-reduce of the gradient backward;
* ``g`` = ``reduce_from_parallel_region``: all-reduce forward, identity backward.

A column-parallel linear followed by a row-parallel one (``f -> A_r -> nonlinearity -> B_r -> g``)
therefore costs one all-reduce of the activation forward and one backward. Activations outside
the parallel region are identical on every rank, and so are the gradients of the replicated
parameters (layer norms, the row layer's bias): they need no extra synchronisation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distframe.backends.functional import (all_reduce, copy_to_parallel_region,
                                           gather_from_parallel_region,
                                           reduce_from_parallel_region,
                                           scatter_to_parallel_region)
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.tensor_parallel_loss import compute_dtype
from distframe.models.tensor_parallel_region import mark_split, sum_replicated_gradients


def shard_range(size: int, backend: ICommunicationBackend, what: str) -> tuple[int, int]:
    """``[lo, hi)`` of this rank's equal share of ``size``; ConfigError unless it divides."""
    if size % backend.world_size:
        raise ConfigError(f"{what} ({size}) is not divisible by the tensor-parallel degree "
                          f"{backend.world_size}; choose tp dividing it")
    per = size // backend.world_size
    return backend.rank * per, (backend.rank + 1) * per


def _slice_param(param: torch.Tensor, dim: int, lo: int, hi: int) -> nn.Parameter:
    piece = param.detach().narrow(dim, lo, hi - lo).clone()
    return mark_split(nn.Parameter(piece, requires_grad=param.requires_grad), dim)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with the output features split: rank r holds rows ``r*out/t..`` of A.

    Forward: ``f`` on the input (unless ``copy_input=False``: the caller already applied it, as a
    fused q/k/v does), the local matmul, and with ``gather_output`` an all-gather of the last dim
    (backward: keep the slice). Holds ``weight (out/t, in)`` and ``bias (out/t)``.
    """

    # Until SplitOutputCheck (tensor_parallel_flow) has run: the latest output's autograd node.
    record_output, output_node = False, None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, backend: ICommunicationBackend,
                 *, gather_output: bool = False, copy_input: bool = True) -> None:
        super().__init__()
        self.backend = backend
        self.weight, self.bias = weight, bias
        self.gather_output, self.copy_input = gather_output, copy_input

    @classmethod
    def from_dense(cls, dense: nn.Linear, backend: ICommunicationBackend, *, gather_output: bool = False,
                   copy_input: bool = True, shared: dict | None = None) -> ColumnParallelLinear:
        lo, hi = shard_range(dense.out_features, backend, "out_features")
        weight = _shared_slice(dense.weight, 0, lo, hi, shared)
        bias = None if dense.bias is None else _slice_param(dense.bias, 0, lo, hi)
        return cls(weight, bias, backend, gather_output=gather_output, copy_input=copy_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() and x.shape[-1] != self.weight.shape[1]:
            sliced = x.shape[-1] * self.backend.world_size == self.weight.shape[1]
            raise ValueError(f"{_planned(self, 'column')} expects the full input width "
                             f"{self.weight.shape[1]} but got {x.shape[-1]}"
                             + (", one rank's slice: its input is the split output of another 'column' "
                                "layer; plan the layer that consumes a 'column' output 'row'"
                                if sliced else ""))
        if self.copy_input:
            x = copy_to_parallel_region(x, self.backend)
        y = F.linear(x, self.weight, self.bias)  # (..., out/t)
        if self.gather_output:
            return gather_from_parallel_region(y, self.backend)
        if self.record_output:
            self.output_node = y.grad_fn
        return y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with the input features split: rank r holds columns ``r*in/t..`` of A.

    Forward: with ``input_is_parallel=False`` the input is first cut to this rank's slice of the
    last dim; the local matmul gives a partial sum, ``g`` all-reduces it, then the (replicated)
    bias is added once. Holds ``weight (out, in/t)`` and the full ``bias (out)``. A replicated
    value its split input was computed with (a scalar PReLU weight after its 'column' partner)
    gets the gradient summed over the group ([Note: replicated values inside the split region]).
    """

    record_output, output_node = False, None  # as ColumnParallelLinear's

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, backend: ICommunicationBackend,
                 *, input_is_parallel: bool = True) -> None:
        super().__init__()
        self.backend = backend
        self.weight, self.bias = weight, bias
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_dense(cls, dense: nn.Linear, backend: ICommunicationBackend, *,
                   input_is_parallel: bool = True, shared: dict | None = None) -> RowParallelLinear:
        lo, hi = shard_range(dense.in_features, backend, "in_features")
        weight = _shared_slice(dense.weight, 1, lo, hi, shared)
        bias = None if dense.bias is None else dense.bias
        return cls(weight, bias, backend, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.weight.shape[1]
        if self.input_is_parallel and x.dim() and x.shape[-1] != local:
            full = local * self.backend.world_size
            raise ValueError(f"{_planned(self, 'row')} expects its input split over the "
                             f"{self.backend.world_size} tensor ranks (last dim {local} of {full}) but got "
                             + (f"the full width {full}: in the forward it must take its 'column' "
                                "sibling's output; plan it on its own (no 'column' sibling) or change "
                                "the plan"
                                if x.shape[-1] == full else f"last dim {x.shape[-1]}"))
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.backend)
        elif torch.is_grad_enabled() and x.grad_fn is not None:
            sum_replicated_gradients(x.grad_fn, self.backend)  # see tensor_parallel_region
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.backend)  # (..., out)
        y = y if self.bias is None else y + self.bias
        if self.record_output:
            self.output_node = y.grad_fn
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split: rank r holds rows ``[r*V/t, (r+1)*V/t)``.

    Forward: ids outside the full vocabulary ``[0, V)`` raise IndexError (see [Note: token id
    check]); tokens outside this rank's range look up row 0 and are zeroed, then ``g``
    all-reduces the partial embeddings (every token is found on exactly one rank). Backward is
    local: each rank's rows get the gradient of its own tokens.

    [Note: token id check] Masking alone would give an id outside ``[0, V)`` a zero row on every
    rank: a silently wrong input where ``nn.Embedding`` raises. Every rank of the tensor group
    holds the same full ids (they take the same batch), so a local check of their min and max
    (one ``aminmax``) agrees on every rank, which raises before the all-reduce: the group stays in
    step. On an accelerator reading the two values is a host sync; it is taken on purpose. The
    embedding is the first op of a step and ``train_step`` already syncs once a step for its
    loss, so little work is queued to wait for, and the alternative, a device-side assert (what
    torch's own embedding kernel does), aborts the process with no Python error for the peers,
    which then wait in the all-reduce until their timeout. The cost: the forward cannot be
    captured whole in a CUDA graph (``torch.compile`` breaks the graph here).
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, backend: ICommunicationBackend) -> None:
        super().__init__()
        self.backend = backend
        self.weight = weight
        self.vocab_start = vocab_start

    @classmethod
    def from_dense(cls, dense: nn.Embedding, backend: ICommunicationBackend, *,
                   shared: dict | None = None) -> VocabParallelEmbedding:
        # Each of these changes the gradient or the weights per id, which the masked local
        # lookup does not reproduce (scale_grad_by_freq would count every foreign id as id 0;
        # sparse=True would get a dense gradient, which torch.optim.SparseAdam refuses).
        options = {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False}
        given = [f"{option}={getattr(dense, option)!r}" for option, plain in options.items()
                 if getattr(dense, option) != plain]
        if given:
            raise ConfigError(f"VocabParallelEmbedding supports plain embeddings (no padding_idx, "
                              f"no max_norm, no scale_grad_by_freq, sparse=False), got {', '.join(given)}; "
                              "drop those options (build it with sparse=False and an optimizer for dense "
                              "gradients) or leave the embedding replicated")
        lo, hi = shard_range(dense.num_embeddings, backend, "num_embeddings")
        return cls(_shared_slice(dense.weight, 0, lo, hi, shared), lo, backend)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_token_ids(tokens, self.weight.shape[0] * self.backend.world_size)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)  # (..., E)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel_region(embedded, self.backend)


class ShardedLayerNorm(nn.Module):
    """LayerNorm over a feature dim split across the group (each rank holds ``E/t`` features).

    Mean and variance need every rank's features: two differentiable all-reduces of a
    ``(..., 1)`` statistic forward (and two backward), in float32 for float16/bfloat16 features
    (``compute_dtype``). The result equals ``nn.LayerNorm`` applied to the concatenated features,
    sliced to this rank, in the features' dtype (the weights' where that is wider).
    """

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, full_size: int,
                 eps: float, backend: ICommunicationBackend) -> None:
        super().__init__()
        self.backend = backend
        self.weight, self.bias = weight, bias
        self.full_size, self.eps = full_size, eps

    @classmethod
    def from_dense(cls, dense: nn.LayerNorm, backend: ICommunicationBackend) -> ShardedLayerNorm:
        if len(dense.normalized_shape) != 1:
            raise ConfigError("ShardedLayerNorm splits a LayerNorm over one (the last) dim")
        full = dense.normalized_shape[0]
        lo, hi = shard_range(full, backend, "LayerNorm features")
        weight = None if dense.weight is None else _slice_param(dense.weight, 0, lo, hi)
        bias = None if dense.bias is None else _slice_param(dense.bias, 0, lo, hi)
        return cls(weight, bias, full, dense.eps, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float16/bfloat16 features are normalised in float32, as nn.LayerNorm does, and rounded
        # once at the end: in half precision a sum over the features is rounded to 8 or 11 bits
        # and overflows float16 past 65504 (256 features near 300: every output inf or NaN).
        upcast = x.to(compute_dtype(x.dtype))
        mean = all_reduce(upcast.sum(-1, keepdim=True), self.backend) / self.full_size
        centered = upcast - mean
        var = all_reduce(centered.square().sum(-1, keepdim=True), self.backend) / self.full_size
        y = centered * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight
        y = y if self.bias is None else y + self.bias
        dtype = x.dtype  # rounded once to the dtype of x, or of the weights where wider (as before)
        for param in (self.weight, self.bias):
            dtype = dtype if param is None else torch.promote_types(dtype, param.dtype)
        return y.to(dtype)


def _planned(layer: nn.Module, style: str) -> str:
    """How a wiring error names the layer: by the plan's name for it when a plan made it."""
    name = getattr(layer, "plan_name", None)
    return f"{type(layer).__name__}" if name is None else f"{name!r} ({style})"


def _check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """IndexError naming the ids' range unless every id is in ``[0, vocab_size)``; one min/max
    reduction and one small read to the host (see [Note: token id check])."""
    if tokens.numel() == 0:
        return
    lowest, highest = torch.stack(torch.aminmax(tokens)).tolist()
    if lowest < 0 or highest >= vocab_size:
        raise IndexError(f"VocabParallelEmbedding got token ids in [{lowest}, {highest}], outside its "
                         f"vocabulary of {vocab_size} (valid ids: 0 to {vocab_size - 1}); "
                         "fix the tokenizer or the data, or enlarge num_embeddings")


def _shared_slice(param: nn.Parameter, dim: int, lo: int, hi: int, shared: dict | None) -> nn.Parameter:
    """The slice of ``param``; a parameter tied between layers (an embedding and the LM head) is
    sliced once so the layers keep sharing one Parameter, split the same way."""
    if shared is None:
        return _slice_param(param, dim, lo, hi)
    key = id(param)
    if key in shared:
        piece, piece_dim = shared[key]
        if piece_dim != dim:
            raise ConfigError("a tied weight is split along different dims by the plan; split both "
                              "tied layers along the same dim (vocab embedding with column head)")
        return piece
    piece = _slice_param(param, dim, lo, hi)
    shared[key] = (piece, dim)
    return piece
