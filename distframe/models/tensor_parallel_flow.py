"""SplitOutputCheck: a 'column' layer's split output must be taken by a 'row' layer.

[Note: a split output that no row takes] A ColumnParallelLinear without ``gather_output`` leaves
each tensor rank its own slice of the output features; only a RowParallelLinear (whose all-reduce
sums the partial products) turns that back into the dense model's activation. The plan pairs a
column with a row by position (``tensor_parallel_plan``), which cannot see the dataflow of a
custom module: a classifier head beside an MLP's column -> row pair in one module is paired with
that row, and each rank would return a slice of the logits, a silently wrong model. So at the
first forward with grad of each module whose output is the model's (the model, or its last
pipeline stage: a split activation may cross to the stage holding its row), the autograd graph
is walked back from that output, stopping at the rows' outputs: reaching a split column's output
is a ConfigError on every tensor rank (they run the same plan). The layers record their
output's node only until then, so no graph is kept alive afterwards. A first forward without
grad is checked by following the split outputs through its ops instead
([Note: ops across the split features] in tensor_parallel_mixing).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.models.backward_end import tensors_in
from distframe.models.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class SplitOutputCheck:
    """Checks each of ``modules`` (those of this rank whose output is the model's) once, at its
    first forward with grad, then stops the layers' recording."""

    def __init__(self, modules: list[nn.Module]) -> None:
        layers = [m for top in modules for m in top.modules()]
        self.columns = [m for m in layers if isinstance(m, ColumnParallelLinear) and not m.gather_output]
        self.rows = [m for m in layers if isinstance(m, RowParallelLinear)]
        self.handles = {}
        if self.columns:
            for layer in self.columns + self.rows:
                layer.record_output = True
            self.handles = {id(m): m.register_forward_hook(self._check) for m in modules}

    def _check(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.handles.pop(id(module)).remove()
        try:
            self._walk(output)
        finally:
            if not self.handles:
                for layer in self.columns + self.rows:
                    layer.record_output, layer.output_node = False, None

    def _walk(self, output: Any) -> None:
        stops = {id(row.output_node) for row in self.rows if row.output_node is not None}
        split = {id(c.output_node): c for c in self.columns if c.output_node is not None}
        stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in stops:
                continue
            seen.add(id(node))
            column = split.get(id(node))
            if column is not None:
                raise split_output_error(column)
            stack.extend(next_node for next_node, _ in node.next_functions)


def split_output_error(column: ColumnParallelLinear) -> ConfigError:
    name = getattr(column, "plan_name", "a 'column' layer")
    return ConfigError(
        f"plan[{name!r}]='column' is paired with a 'row' layer planned beside it, so its output "
        f"stays split over the {column.backend.world_size} tensor ranks, but that output "
        "reaches the model's output without passing through a 'row' layer: each rank would "
        "return its own slice. Move the layer into a module of its own (a head beside an "
        "MLP's column -> row pair), or into an nn.Sequential, where the order pairs layers")
