"""The gradient of a replicated value used inside a split region, summed over the tensor group.

[Note: replicated values inside the split region]
Between a 'column' layer and the 'row' layer that takes its output, each tensor rank holds its own
slice of the hidden features. Megatron lets a replicated tensor into that region only through
``f`` (``copy_to_parallel_region``), whose backward sums the ranks' partial gradients; the plan
inserts ``f`` where the column layers read their input. Anything else replicated that the region
uses gets, on each rank, the gradient of its own slice alone: a scalar ``nn.PReLU`` weight between
the two layers, a per-token gate multiplying the hidden features, a weight shared with the
replicated stream. The ranks' replicated parameters then drift apart, silently.

So each 'row' layer, at every forward with grad, walks the autograd graph back from its input and
gives every edge that leaves the region for a replicated value the backward of ``f``: a node hook
that all-reduces (SUM, over the tensor group) the gradient sent along that edge, and only that
one, so a parameter also used outside the region keeps its other uses' gradient as it is. Exact
wherever the region's forward is, i.e. where it acts on each feature slice by itself (the same
condition as for the activation between the layers). The region ends at what is split (this
rank's slices of the split parameters, the column layers' outputs computed from them), and at
what already sums the ranks' gradients (``f``, a differentiable all-reduce such as a sharded layer
norm's statistics, ``scatter``); a value that reaches neither is replicated, as is the output of
``g`` (a row layer's all-reduce) or of a gather. Every tensor rank builds the same graph, so they
add the same hooks and run their all-reduces in the same order. The walk visits the region's
nodes once per row layer and forward (a handful for an MLP or the head-split attention), and
each replicated value's history only until it is seen to hold nothing split.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from distframe.backends import functional
from distframe.backends.protocol import ICommunicationBackend

# The autograd Functions of distframe.backends.functional, by what a value behind them is.
_SUMMED = (functional._CopyToParallel, functional._AllReduce, functional._ScatterToParallel)
_REPLICATED = (functional._ReduceFromParallel, functional._GatherFromParallel)
SPLIT_DIM = "tensor_parallel_split_dim"  # the attribute marking a split Parameter (its dim)
_HOOKED = "tensor_parallel_summed_edges"  # Node.metadata: edges whose gradient is summed already


def mark_split(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Marks ``param`` as this rank's slice along ``dim`` (what the region walk treats as split)."""
    setattr(param, SPLIT_DIM, dim)
    return param


def sum_replicated_gradients(start: Any, backend: ICommunicationBackend) -> None:
    """Hooks every edge from the split region ending at ``start`` (a row layer's input node) to a
    replicated value so that the gradient along it is summed over ``backend`` (see the note)."""
    reaches: dict[int, bool] = {}
    if _kind(start) != "other" or not _reaches_split(start, reaches):
        return  # split already, or a replicated input (the row layer's wiring error, not this walk's)
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for index, (child, _) in enumerate(node.next_functions):
            kind = "none" if child is None else _kind(child)
            if kind in ("none", "summed", "split"):
                continue
            if kind == "replicated" or not _reaches_split(child, reaches):
                _sum_edge(node, index, backend)
            else:
                stack.append(child)


def _kind(node: Any) -> str:
    """"split", "summed", "replicated" or "other" (see the note)."""
    forward = getattr(node, "_forward_cls", None)
    if forward is not None and issubclass(forward, _SUMMED):
        return "summed"
    if forward is not None and issubclass(forward, _REPLICATED):
        return "replicated"
    variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
    if variable is not None:
        split = not isinstance(variable, nn.Parameter) or hasattr(variable, SPLIT_DIM)
        # A leaf that is no parameter (a pipeline stage's input) may be a split activation.
        return "split" if split else "replicated"
    return "other"


def _reaches_split(node: Any, memo: dict[int, bool]) -> bool:
    """Whether ``node``'s value depends on anything split or already summed (then it is inside the
    region, or behind a boundary that sums); iterative, as graphs may be deep."""
    stack = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        key = id(current)
        if key in memo:
            continue
        kind = _kind(current)
        if kind != "other":
            memo[key] = kind in ("split", "summed")
            continue
        children = [child for child, _ in current.next_functions if child is not None]
        if expanded:
            memo[key] = any(memo.get(id(child), False) for child in children)
            continue
        stack.append((current, True))
        stack.extend((child, False) for child in children if id(child) not in memo)
    return memo[id(node)]


def _sum_edge(node: Any, index: int, backend: ICommunicationBackend) -> None:
    """From now on this graph's backward sums over ``backend`` the gradient ``node`` sends along
    its edge ``index``; once per edge, however many row layers reach it."""
    hooked = node.metadata.setdefault(_HOOKED, set())
    if index in hooked:
        return
    if not hooked:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
            # f's backward (reduce_from_parallel_region): differentiable, for second derivatives.
            return tuple(functional.reduce_from_parallel_region(grad, backend)
                         if i in hooked and grad is not None else grad for i, grad in enumerate(grad_inputs))
        node.register_hook(hook)
    hooked.add(index)

