"""The last stage's output when it is not one tensor: a tuple, list or dict (nested) of tensors.

A forward without autograd (``model(x)`` on a pipeline, ``validation_loss``) concatenates the
micro-batches' outputs along dim 0, and the last stage then broadcasts the result to the other
ranks of the pipeline, which do not know its structure. ``flatten_output`` turns an output into
a layout (int64 codes, preorder) and its tensor leaves; ``unflatten_output`` rebuilds it from
them. Pure bookkeeping; ``pipeline_comm.broadcast_any`` moves them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.errors import ConfigError

_TENSOR, _TUPLE, _LIST, _DICT = 0, 1, 2, 3
_WHAT = ("the pipeline's output (the last stage's) must be a tensor, or a tuple, list or dict "
         "with str keys of them (nested)")


def flatten_output(value: Any) -> tuple[list[int], list[torch.Tensor]]:
    """``(layout, leaves)`` of ``value``; ConfigError for anything else than the module says."""
    layout: list[int] = []
    leaves: list[torch.Tensor] = []
    _flatten(value, layout, leaves)
    return layout, leaves


def _flatten(value: Any, layout: list[int], leaves: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        layout.append(_TENSOR)
        leaves.append(value)
    elif type(value) in (tuple, list):  # a namedtuple's type could not be rebuilt on the others
        layout += [_TUPLE if type(value) is tuple else _LIST, len(value)]
        for item in value:
            _flatten(item, layout, leaves)
    elif type(value) is dict and all(isinstance(k, str) for k in value):
        layout += [_DICT, len(value)]
        for key, item in value.items():
            encoded = key.encode()
            layout += [len(encoded), *encoded]
            _flatten(item, layout, leaves)
    else:
        raise ConfigError(f"{_WHAT}; got a {type(value).__name__} in it")


def unflatten_output(layout: list[int], leaf: Callable[[], torch.Tensor]) -> Any:
    """The value ``layout`` describes, taking its tensors in order from ``leaf()``."""
    value, position = _unflatten(layout, 0, leaf)
    if position != len(layout):
        raise RuntimeError("a pipeline output's layout has codes left over")
    return value


def _unflatten(layout: list[int], i: int, leaf: Callable[[], torch.Tensor]) -> tuple[Any, int]:
    code = layout[i]
    if code == _TENSOR:
        return leaf(), i + 1
    count, i = layout[i + 1], i + 2
    if code in (_TUPLE, _LIST):
        items = []
        for _ in range(count):
            item, i = _unflatten(layout, i, leaf)
            items.append(item)
        return (tuple(items) if code == _TUPLE else items), i
    out = {}
    for _ in range(count):
        size = layout[i]
        key = bytes(layout[i + 1:i + 1 + size]).decode()
        out[key], i = _unflatten(layout, i + 1 + size, leaf)
    return out, i


def concat_microbatches(outputs: list[Any]) -> Any:
    """The micro-batches' outputs joined along dim 0 leaf by leaf: the whole slice's output."""
    flat = [flatten_output(out) for out in outputs]
    if len(outputs) == 1:
        return outputs[0]
    layout = flat[0][0]
    if any(other != layout for other, _ in flat[1:]):
        raise ConfigError("the pipeline's last stage returned outputs of different structures for "
                          "different micro-batches; return the same structure for every batch")
    joined = []
    for index, leaf in enumerate(flat[0][1]):
        if leaf.dim() == 0:
            raise ConfigError(f"the pipeline's output holds a 0-dim tensor (leaf {index}), which "
                              "cannot be joined over micro-batches along dim 0; return per-sample "
                              "values (reduce them in loss_fn) or use num_microbatches=1")
        joined.append(torch.cat([leaves[index] for _, leaves in flat]))
    return unflatten_output(layout, iter(joined).__next__)


_NO_BACKWARD = ("a pipelined or context-parallel model's forward output is broadcast or gathered "
                "outside autograd (a pipeline runs every micro-batch without it), so a backward "
                "through it cannot reach the parameters: train with "
                "model.train_step(batch, loss_fn, optimizer) (or model.forward_backward(batch, loss_fn) "
                "for the gradients alone), and run evaluation under torch.no_grad()")


class _RefuseBackward(torch.autograd.Function):
    """Passes an output through; its backward raises (``refuse_backward``)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:
        raise ConfigError(_NO_BACKWARD)


def refuse_backward(output: Any) -> Any:
    """``output`` (a pipeline's forward without autograd, or a context-parallel output gathered
    outside it) with each floating leaf in a graph whose backward
    raises ConfigError saying to use train_step: a hand-written ``loss.backward()`` got torch's
    "does not require grad", or, with a term that reaches the parameters (a penalty), ran and
    left that term's gradients alone. Only where grad mode is on: under torch.no_grad() the
    output is returned as it is."""
    if not torch.is_grad_enabled() or output is None:
        return output
    layout, leaves = flatten_output(output)
    anchor = torch.zeros((), requires_grad=True)
    leaves = [_RefuseBackward.apply(t, anchor) if t.is_floating_point() or t.is_complex() else t
              for t in leaves]
    return unflatten_output(layout, iter(leaves).__next__)
