"""Gradient accumulation inside ``train_step(..., accumulation_steps=N)``: this rank's slice is cut
into N equal pieces along dim 0, run forward and backward one after another, all but the last
under ``no_sync()``, so the strategy synchronises once per step, as for one backward of the whole
slice, while only one piece's activations are alive at a time (nanoGPT's and Hugging Face's
``gradient_accumulation_steps``; the global batch stays what the step is given).

[Note: accumulation is exact] ``loss_fn`` returns the mean over what it is given, and the pieces
are equal, so the slice's mean loss is the mean of the pieces' means: each piece's loss is scaled
by 1/N before its backward, the gradients add up to the whole slice's, and the scaled losses add
up to its loss. No communication of its own: pipelines run their micro-batches within each piece
(``num_microbatches`` must divide the piece), hybrid and data-parallel models synchronise at the
last piece's backward as ``no_sync`` documents.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from distframe.errors import ConfigError
from distframe.models.inputs import train_batch


def accumulated_backward(model: Any, batch: tuple[Any, Any], loss_fn: Callable, steps: int) -> torch.Tensor:
    """``model.forward_backward`` over ``steps`` pieces of ``batch`` (see the module notes);
    returns this rank's loss over the whole slice."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"accumulation_steps={steps!r}: use an integer >= 1 (1: no accumulation)")
    _refuse_empty(batch, model.backend.rank)
    if steps == 1:
        return model.forward_backward(batch, loss_fn)

    def scaled(output: Any, targets: Any) -> torch.Tensor:
        return loss_fn(output, targets) / steps

    # a pipeline cuts each piece into its micro-batches: check the slice against both at once
    micro = getattr(getattr(model, "runner", None), "num_microbatches", 1)
    total = None
    for k, piece in enumerate(split_batch(batch, steps, micro)):
        with model.no_sync() if k < steps - 1 else contextlib.nullcontext():
            loss = model.forward_backward(piece, scaled).detach()
        total = loss if total is None else total + loss
    return total


def split_batch(batch: tuple[Any, Any], steps: int, num_microbatches: int = 1) -> list[tuple[Any, Any]]:
    """``batch = (inputs, targets)`` cut into ``steps`` equal pieces along dim 0 of every tensor
    in it (tuples, lists and dicts are looked into; anything else goes whole to every piece).
    ``num_microbatches``: what a pipeline then cuts each piece into, so dim 0 must be a multiple
    of both (an error naming the piece's size alone would send the user to the wrong knob)."""
    leaves, spec = tree_flatten(train_batch(batch))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] % (steps * num_microbatches)):
            need, what = ((steps, f"accumulation_steps={steps}") if num_microbatches == 1 else
                          (steps * num_microbatches, f"accumulation_steps={steps} x num_microbatches="
                                                     f"{num_microbatches} = {steps * num_microbatches}"))
            raise ConfigError(
                f"{what} must divide dim 0 of every tensor of the batch, got shape {tuple(leaf.shape)}; "
                f"pass a slice of a multiple of {need} samples, or fewer accumulation steps")
    chunks = [leaf.chunk(steps) if isinstance(leaf, torch.Tensor) else [leaf] * steps for leaf in leaves]
    return [tree_unflatten([chunk[k] for chunk in chunks], spec) for k in range(steps)]


def _refuse_empty(batch: tuple[Any, Any], rank: int) -> None:
    """ConfigError for a slice of 0 rows: its mean loss is NaN (0/0), and the gradients of the
    other data-parallel ranks would be averaged with its zeros, silently halving the step."""
    leaves, _ = tree_flatten(train_batch(batch))
    empty = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() and not len(t)), None)
    if empty is not None:
        raise ConfigError(f"train_step on rank {rank} got an empty slice (a tensor of shape "
                          f"{tuple(empty.shape)}): give every data-parallel rank at least one sample "
                          "(a global batch at least the data-parallel degree), or skip the step on all ranks")
