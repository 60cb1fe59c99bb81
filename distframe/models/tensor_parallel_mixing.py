"""FeatureMixingCheck: what runs between a 'column' layer and its 'row' must keep to each feature.

[Note: ops across the split features]
Between a ColumnParallelLinear whose output stays split and the RowParallelLinear that takes it,
each tensor rank computes on its own slice of the hidden features. That equals the dense model
only where every op acts on each feature by itself (an activation, a dropout, a per-token gate),
as Megatron requires. An op along the feature dim computes something else on a slice, with the
shapes still agreeing, so nothing fails: a fused gate/up projection cut in two by ``chunk`` (each
rank's halves are not the dense halves), a softmax or a norm over the features, a slice of some
features. The plan cannot see this in a module's own forward (``tensor_parallel_plan`` pairs a
column with any sibling row there), so the first forward of each of this rank's stage modules
runs under a TorchFunctionMode that follows the columns' split outputs: through ops that keep
their last dim (elementwise ones, views that keep it), raising ConfigError on every tensor rank
(they run the same code) at an op that works along that dim. Ops that reshape it (a custom
attention's split into heads) end the following: what they do is the model's business and may
be right. Inside distframe's own split-aware layers (rows, sharded norms, the split attention)
nothing is checked.

The first forward without grad also checks what SplitOutputCheck checks only with grad (there
is no autograd graph to walk without it): that no split output reaches the model's output,
following it through every op. A model only evaluated, or evaluated before it trains, returned
each rank's slice and a validation loss that differed between ranks.

[Note: split parameters read outside their layer]
A parameter the plan splits (a 'vocab' embedding's weight, a column's weight and bias, a row's
weight, a sharded norm's) holds one rank's slice. Only its split-aware layer knows that; a forward
that reads it itself (a GPT-style tie, ``logits = h @ self.emb.weight.t()``) computes with the
slice, and the shapes may still agree: each rank returned its share of the logits. So the same
first forward refuses a torch function outside those layers that takes such a parameter, before
it runs (the op might fail on the slice's shape, less clearly). Reads of what it is rather than of
its values (``weight.dtype``, ``.device``, ``.shape``, ``.size()``) are let through: a cast to a
layer's dtype is common and right, though a shape read gets the local size.

[Note: draws from the global generator]
A forward that draws from torch's global generator itself (``F.dropout`` in a module's forward
rather than an ``nn.Dropout`` module, ``torch.randn`` noise, the dropout of an attention op, which
takes no generator: ``F.scaled_dot_product_attention(dropout_p > 0)``, ``nn.MultiheadAttention(dropout
> 0)`` in training; ``mp_global_draws.DRAWS`` lists them) gives each tensor rank another draw
where its activations are replicated: in-memory ranks are threads sharing that generator, and
process ranks are seeded by the user (alike or not). The ranks' replicated parameters then drift
apart, silently ([Note: dropout and the tensor group] in tensor_parallel_rng). So the first
forward in training mode (and the first forward at all) refuses such a draw, as
``replace_dropouts`` refuses dropout modules it cannot replace; draws given a generator, and
those inside distframe's split-aware layers, are the layers' own business.

The checks cost a forward under a Python mode (some microseconds per op), the first one and the
first in training mode, and are skipped when Dynamo compiles around the model
(``compile_support``).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from distframe.compile_support import _compiling_around
from distframe.errors import ConfigError
from distframe.models.mp_global_draws import DRAWS, attention_names, draws_from_global, global_draw_error
from distframe.models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm,
                                              VocabParallelEmbedding)
from distframe.models.tensor_parallel_attention import TensorParallelDilatedAttention
from distframe.models.tensor_parallel_flow import SplitOutputCheck, split_output_error
from distframe.models.tensor_parallel_plan import split_dims

ALL = "all"
# op -> (position of its dim argument, its default); ALL: every dim (a whole-tensor reduction).
_ALONG = {name: (1, ALL) for name in (
    "sum", "nansum", "mean", "nanmean", "prod", "var", "std", "var_mean", "std_mean", "amax", "amin",
    "max", "min", "argmax", "argmin", "all", "any", "median", "nanmedian", "count_nonzero")}
_ALONG.update({name: (1, None) for name in (
    "narrow", "select", "index_select", "gather", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "logsumexp", "flip", "take_along_dim", "scatter", "scatter_add", "index_add",
    "index_copy", "index_fill")})
_ALONG.update({"softmax": (1, "implicit"), "log_softmax": (1, "implicit"), "softmin": (1, "implicit"),
               "glu": (1, -1), "unbind": (1, 0), "sort": (1, -1), "argsort": (1, -1), "mode": (1, -1),
               "chunk": (2, 0), "split": (2, 0), "tensor_split": (2, 0), "split_with_sizes": (2, 0),
               "unsafe_split": (2, 0), "unsafe_chunk": (2, 0), "topk": (2, -1), "kthvalue": (2, -1),
               "diff": (2, -1), "roll": (2, ALL), "normalize": (2, 1), "norm": (2, ALL),
               "cat": (1, 0), "concat": (1, 0), "concatenate": (1, 0)})
# Ops over the whole last dim whatever their arguments (a norm's shape, a product's contraction).
_WHOLE_LAST = {"layer_norm", "rms_norm", "group_norm", "local_response_norm", "linear", "matmul",
               "mm", "bmm", "__matmul__", "bilinear"}
# Ops that keep the last dim as it is when they keep its size.
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as",
          "broadcast_to", "view_as", "reshape_as"}
# Ops that may move the last dim elsewhere though its size stays: not followed.
_MOVES = {"transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "t", "mT", "T", "mH",
          "H", "adjoint", "rot90"}
# What a read of a split parameter may ask: what it is, not its values (see the note on them).
_METADATA = {"dtype", "device", "shape", "ndim", "layout", "requires_grad", "is_leaf", "grad", "grad_fn",
             "_version", "is_cuda", "is_meta", "is_sparse", "is_quantized", "size", "dim", "numel",
             "nelement", "ndimension", "stride", "element_size", "is_floating_point", "is_complex",
             "is_contiguous", "data_ptr", "storage_offset", "get_device", "__hash__", "__len__"}
_AWARE = (ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm, TensorParallelDilatedAttention,
          VocabParallelEmbedding)


def wiring_checks(chunks: list[nn.Module], last: list[nn.Module]) -> tuple[Any, ...]:
    """The checks of a tensor-parallel stage's wiring at its first forward: ``chunks``, this rank's
    stage modules; ``last``, those whose output is the model's."""
    return SplitOutputCheck(last), FeatureMixingCheck(chunks, last)


class FeatureMixingCheck:
    """Checks each of ``chunks`` (this rank's stage modules) at its first forward; ``last``: those
    whose output is the model's (checked for split outputs too, when grad is off)."""

    def __init__(self, chunks: list[nn.Module], last: list[nn.Module]) -> None:
        self.aware = [m for c in chunks for m in c.modules() if isinstance(m, _AWARE)]
        self.split_parameters = _split_parameters(chunks)
        self.attentions = attention_names(chunks)  # names them in the error for their dropout
        self.reach = {id(c) for c in last}
        self.handles: dict[int, list[Any]] = {}
        self.tracker: _Tracker | None = None
        for chunk in chunks:
            self.handles[id(chunk)] = [chunk.register_forward_pre_hook(self._start),
                                       chunk.register_forward_hook(self._end, always_call=True)]

    def _start(self, chunk: nn.Module, args: Any) -> None:
        if self.tracker is not None:  # a forward that ended without its hook (KeyboardInterrupt)
            self.tracker.stop()
        if _compiling_around(chunk):
            self._done(chunk)
            return
        self.tracker = _Tracker(self.aware, self.split_parameters, self.attentions)
        self.tracker.__enter__()

    def _end(self, chunk: nn.Module, args: Any, output: Any) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        tracker.stop()
        if output is None:  # the forward raised: checked again at the next one
            return
        if chunk.training:  # checked until a training forward ran ([Note: draws from the global generator])
            self._done(chunk)
        if id(chunk) in self.reach and not torch.is_grad_enabled():
            split = next((tracker.column_of(t) for t in _tensors(output) if tracker.tainted(t)), None)
            if split is not None:
                raise split_output_error(split)

    def _done(self, chunk: nn.Module) -> None:
        for handle in self.handles.pop(id(chunk), []):
            handle.remove()


class _Tracker(TorchFunctionMode):
    """Follows the split outputs of one forward (see the note); refuses a read of a split parameter
    outside its layer ([Note: split parameters read outside their layer])."""

    def __init__(self, aware: list[nn.Module], split_parameters: dict[int, str],
                 attentions: dict[int, str]) -> None:
        super().__init__()
        self.split_parameters = split_parameters  # id -> name, see the note on them
        self.attentions = attentions  # see mp_global_draws.attention_names
        self.split: dict[int, tuple[weakref.ref, Any]] = {}  # last dim split: -> its column
        self.taint: dict[int, tuple[weakref.ref, Any]] = {}  # holds split values, any layout
        self.depth = 0  # inside distframe's split-aware layers
        self.hooks = [h for m in aware for h in (
            m.register_forward_pre_hook(self._enter_layer),
            m.register_forward_hook(self._leave_layer, always_call=True))]

    def stop(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.__exit__(None, None, None)

    def _enter_layer(self, layer: nn.Module, args: Any) -> None:
        self.depth += 1

    def _leave_layer(self, layer: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth or not isinstance(output, torch.Tensor):
            return
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            self._mark(output, layer, split=True)
        elif isinstance(layer, ShardedLayerNorm):  # keeps the features split as they came
            source = next((t for t in _tensors(args) if self.tainted(t)), None)
            if source is not None:
                self._mark(output, self.column_of(source), split=self._entry(self.split, source) is not None)

    @staticmethod
    def _entry(table: dict, t: Any) -> Any:
        entry = table.get(id(t))
        return entry if entry is not None and entry[0]() is t else None

    def tainted(self, t: Any) -> bool:
        return self._entry(self.taint, t) is not None

    def column_of(self, t: Any) -> Any:
        return self._entry(self.taint, t)[1]

    def _mark(self, t: torch.Tensor, column: Any, *, split: bool) -> None:
        self.taint[id(t)] = (weakref.ref(t), column)
        if split:
            self.split[id(t)] = (weakref.ref(t), column)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.depth:
            self._check_split_parameters(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.depth:
            return out
        name = getattr(func, "__name__", "")
        if name in DRAWS and draws_from_global(name, args, kwargs):
            raise global_draw_error(name, args, kwargs, self.attentions)
        inputs = [t for t in _tensors((args, kwargs)) if self.tainted(t)]
        if not inputs:
            return out
        split = next((t for t in inputs if self._entry(self.split, t) is not None), None)
        if split is not None:
            if _works_along_last(name, args, kwargs, split):
                raise _mixing_error(self.column_of(split), name)
        results = _tensors(out)
        if _in_place(name, kwargs) and args and isinstance(args[0], torch.Tensor):
            results.append(args[0])  # written with split values: holds them now
        for result in results:
            keeps = split is not None and result.dim() and name not in _MOVES and (
                result.shape == split.shape if name not in _VIEWS and name != "__getitem__"
                else result.shape[-1] == split.shape[-1])
            self._mark(result, self.column_of(inputs[0]), split=bool(keeps))
        return out

    def _check_split_parameters(self, func: Any, args: tuple, kwargs: dict) -> None:
        read = next((self.split_parameters[id(t)] for t in _tensors((args, kwargs))
                     if id(t) in self.split_parameters), None)
        if read is None:
            return
        op = getattr(func, "__name__", "")
        if op == "__get__":  # a Tensor property: named by its descriptor (weight.T, weight.dtype)
            op = getattr(getattr(func, "__self__", None), "__name__", op)
        if op not in _METADATA:
            raise _split_read_error(read, op)


def _split_parameters(chunks: list[nn.Module]) -> dict[int, str]:
    """``id -> name`` of each parameter of ``chunks`` the plan splits (``split_dims``), named by its
    planned layer (``plan_name``), else by its name in the stage module."""
    names: dict[int, str] = {}
    for chunk in chunks:
        split = split_dims(chunk)
        for module_name, module in chunk.named_modules():
            prefix = getattr(module, "plan_name", None) or module_name
            for attr, param in module.named_parameters(recurse=False):
                if id(param) in split:
                    names.setdefault(id(param), f"{prefix}.{attr}" if prefix else attr)
    return names


def _split_read_error(param: str, op: str) -> ConfigError:
    return ConfigError(
        f"the model's forward passes {param!r} to {op!r} outside its layer, but the plan splits that "
        "parameter: each tensor rank holds only its slice of it, so the op would compute with one "
        "rank's slice, not what the model computes. Use it through its layer: to tie an output "
        "projection to a 'vocab' embedding, give an nn.Linear planned 'column' the embedding's weight "
        "(head.weight = emb.weight; logits = head(h)), as DilatedTransformerLM's head does; or leave "
        "its layer out of the plan")


def _works_along_last(name: str, args: tuple, kwargs: dict, split: torch.Tensor) -> bool:
    """Whether op ``name`` works along ``split``'s last dim (its split features)."""
    last = split.dim() - 1
    if name in _WHOLE_LAST:
        return name in ("layer_norm", "rms_norm", "group_norm", "local_response_norm") or (
            bool(args) and args[0] is split)  # a product contracting the split features
    if name in ("__getitem__", "__setitem__"):
        return len(args) > 1 and args[0] is split and _indexes_last(args[1], split.dim())
    if name not in _ALONG:
        return False
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return False  # elementwise maximum of two tensors
    at, default = _ALONG[name]
    dim = next((kwargs[k] for k in ("dim", "dims", "axis") if k in kwargs),
               args[at] if len(args) > at else default)
    if isinstance(dim, bool) or dim is None:  # var(x, unbiased), norm(x, p) and the like
        dim = default if default is not None else ALL
    if dim == "implicit":  # F.softmax without dim: torch's legacy choice
        dim = 0 if split.dim() in (0, 1, 3) else 1
    if dim == ALL:
        return True
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return any(isinstance(d, int) and d % max(split.dim(), 1) == last for d in dims)


def _indexes_last(index: Any, ndim: int) -> bool:
    """Whether ``index`` selects within the last of ``ndim`` dims (anything but a full slice)."""
    items = [item for item in (index if isinstance(index, tuple) else (index,)) if item is not None]
    if any(item is Ellipsis for item in items):  # the items after it address the trailing dims
        items = items[items.index(Ellipsis) + 1:]
        items.reverse()
        covered = 0
        for item in items:
            covered += _dims_taken(item)
            if covered:
                return not _whole(item)
        return False
    covered = 0
    for item in items:
        covered += _dims_taken(item)
        if covered >= ndim:
            return not _whole(item)
    return False


def _dims_taken(item: Any) -> int:
    """How many dims an index item addresses: a boolean mask as many as it has."""
    if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
        return max(item.dim(), 1)
    return 1


def _whole(item: Any) -> bool:
    return isinstance(item, slice) and item == slice(None)


def _in_place(name: str, kwargs: dict) -> bool:
    return "out" in kwargs or name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _mixing_error(column: Any, op: str) -> ConfigError:
    name = getattr(column, "plan_name", "a 'column' layer")
    return ConfigError(
        f"plan[{name!r}]='column' is paired with a 'row' layer, so its output stays split over the "
        f"{column.backend.world_size} tensor ranks, and {op!r} works along those split features: each "
        "rank would compute it on its own slice, not what the model computes. Split a fused layer "
        "into one Linear per part (a gate/up projection into a gate and an up Linear, each 'column'), "
        "or leave this layer or its 'row' partner out of the plan")
