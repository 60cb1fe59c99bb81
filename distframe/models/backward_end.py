"""BackwardEnd: run a strategy's gradient finish as the last act of the user's backward pass.

torch DDP's reducer queues its finish on autograd's execution engine from the first gradient
hook of a backward; so do DDP, ZeRO-1/2 (``GradientBuckets``) and ZeRO-3/FSDP (``UnitLifecycle``)
here, through this one piece. ``watch(output)`` hooks the tensors of a forward's output: their
gradient is the first one a backward through them computes, so the finish lands on the user's
backward, not on one nested inside it (reentrant activation checkpointing runs a backward of its
own, which may reach parameters first). ``queue()`` from a parameter hook covers a loss that
bypasses the watched outputs.

[Note: passes that accumulate nothing] ``torch.autograd.grad(out, x, create_graph=True)`` (a
gradient penalty's d(out)/d(input), or d(loss)/d(parameters) for a gradient-norm penalty) runs a
backward through the watched output that accumulates into no parameter's ``.grad``; the step's
backward comes after it. With ``only_if_accumulated`` the finish runs only at the end of a pass in
which a parameter hook reported a gradient (``gradient_accumulated``), as torch DDP's reducer is
armed by its parameters' hooks alone. The output hook still queues the check on the outermost
pass, so a reentrant checkpoint's nested backwards (which accumulate) do not end the step early.
A pass that reached no parameter leaves the reductions to ``synchronize_gradients`` (the step's).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class BackwardEnd:
    """Calls ``finish()`` once at the end of each backward pass that ``queue`` was called in."""

    def __init__(self, finish: Callable[[], None], only_if_accumulated: bool = False) -> None:
        self._finish = finish
        self._queued = False
        self._only_if_accumulated = only_if_accumulated
        self._accumulated = False

    def watch(self, output: Any, hook: Callable[..., Any] | None = None) -> int:
        """Registers ``hook`` (default: ``queue``) on every tensor of ``output`` requiring grad;
        returns how many it hooked (none: a backward from ``output`` goes unseen)."""
        hooked = 0
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(hook or self.queue)
                hooked += 1
        return hooked

    def queue(self, *_: Any) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def gradient_accumulated(self) -> None:
        """From a parameter's hook: this pass reached a ``.grad``; queues the finish if not yet."""
        self._accumulated = True
        self.queue()

    def reset(self) -> None:
        """Forgets a queued finish whose backward raised before running it."""
        self._queued = False
        self._accumulated = False

    def _run(self) -> None:
        self._queued = False
        accumulated, self._accumulated = self._accumulated, False
        if accumulated or not self._only_if_accumulated:
            self._finish()


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's ``output`` (or arguments): in torch's pytree containers (tuples,
    lists, dicts, namedtuples, types registered with it) and in the fields of dataclasses
    (ModelOutput-style results, which pytree treats as leaves) at any depth."""
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from tensors_in(getattr(leaf, field.name))


class PassAccumulation:
    """Whether the running backward pass accumulates into any of ``params``' ``.grad``.

    [Note: a pass that only reads gradients] ``torch.autograd.grad(out.sum(), x)`` (a saliency
    map, an input gradient) and ``backward(inputs=[x])`` run the units' backward hooks, but no
    parameter's gradient accumulator: ZeRO-3/FSDP reduce-scattered zeros at each unit's end and
    warned that every parameter got no gradient. A parameter's ``AccumulateGrad`` node is in the
    engine's plan for a pass exactly when the pass accumulates into it, and which call started the
    pass is the same on every rank, so the answer is too (a rank whose forward used no parameter
    at all would differ; its loss would not reach the model). Asked once per pass (autograd's
    graph task id); outside a backward (``synchronize_gradients``) the answer is yes."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._task, self._answer = -1, True

    def accumulates(self) -> bool:
        task = torch._C._current_graph_task_id()
        if task < 0:
            return True
        if task != self._task:
            self._task, self._answer = task, any(_will_run(_accumulator(p)) for p in self._params)
        return self._answer


def _accumulator(param: torch.nn.Parameter) -> Any:
    """``param``'s gradient accumulator now, asked for each pass, not kept: a change of ``.data``'s
    dtype (``summon_full_parameters`` under a MixedPrecisionPolicy) gives the parameter a new one,
    and a kept one was never run again (so no pass accumulated, and no step reduced)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


def _will_run(node: Any) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as error:
        # autograd.grad(out, inputs=[parameter]): the engine captures the parameter's gradient
        # instead of accumulating it, and refuses to say so for a node it captures from. Any
        # other refusal: assume it accumulates (reduce as before rather than skip a reduction).
        return "autograd.grad" not in str(error)
