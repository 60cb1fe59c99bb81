"""Activation checkpointing of a transformer block with the dropout masks it drew.

[Note: activation checkpointing]
A checkpointed block keeps only its input; backward runs its forward again to get the
activations it needs (``torch.utils.checkpoint``, non-reentrant). The recomputation must draw
the dropout masks the first forward drew, or its gradients belong to another network. torch
restores its global CPU and device generators for that; a module drawing from a generator of its
own (``dropout_generator(device)``: the main job's per-rank generators, tensor parallelism's
replicated and split ones) is not covered. So ``same_dropout_masks`` gives checkpoint a pair of
contexts: the forward one notes the state of every such generator of the block as the forward
starts; the recomputation one sets them to it and, when the recomputation ends, back to where
they were (later blocks and steps have drawn from them since), so the stream goes on as though
nothing had been recomputed.

[Note: activation checkpointing under torch.compile] Compiled, a block's checkpoint is traced
whole, and AOTAutograd decides what to recompute from the joint graph with the dropout masks the
forward drew (tests/attention/test_compiled_op.py: with dropout, the uncompiled run's losses).
It takes only checkpoint's default contexts: it refuses contexts that are not dispatch modes, and a
mode would run as the graph is traced, not as it runs. So a compiled block checkpoints plainly when
none of its modules draws from a generator of its own (``draws_from_own_generators`` in
attention/model.py, which Dynamo traces), and otherwise calls ``checkpoint_with_same_masks``: this
module is on Dynamo's skip list, so that call breaks the graph and checkpoints as uncompiled.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def dropout_generators(module: nn.Module, device: torch.device) -> list[torch.Generator]:
    """The generators of their own that ``module``'s submodules draw dropout masks from, once each."""
    found: list[torch.Generator] = []
    for sub in module.modules():
        named = getattr(sub, "dropout_generator", None)
        generator = named(device) if callable(named) else None
        if generator is not None and all(generator is not other for other in found):
            found.append(generator)
    return found


def checkpoint_with_same_masks(module: nn.Module, forward: Callable, *args: Any) -> Any:
    """``forward(*args)`` checkpointed (non-reentrant) with ``same_dropout_masks(module, ...)``:
    ``args[0]``'s device names the generators."""
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(same_dropout_masks, module, args[0].device))


def same_dropout_masks(module: nn.Module, device: torch.device
                       ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` (see the note)."""
    generators = dropout_generators(module, device)
    at_forward: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        at_forward[:] = [g.get_state() for g in generators]
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = [g.get_state() for g in generators]
        for generator, state in zip(generators, at_forward):
            generator.set_state(state)
        try:
            yield
        finally:
            for generator, state in zip(generators, now):
                generator.set_state(state)

    return forward(), recompute()
