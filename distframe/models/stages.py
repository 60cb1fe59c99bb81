"""Splitting a model into pipeline stages: which layers, in what order, on which stage.

A model is first seen as a sequence of *layers* (each a module taking one tensor to one tensor):

* an ``nn.Sequential``, an ``nn.ModuleList`` or a Python list of modules: its items;
* a ``DilatedTransformerLM`` (anything with ``tok_embedding``, ``pos_embedding``, ``blocks``,
  ``final_norm`` and ``head``): ``embed`` (token + position), each block, then ``head``
  (final norm and head);
* a module with a ``pipeline_layers()`` method returning ``[(name, module), ...]``.

The layers are then cut into contiguous stages, balanced by parameter count (minimising the
largest stage) or at user-given ``split_points`` (the layer index where each stage after the
first begins). Pure bookkeeping; no communication.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import nn

from attention.positions import shard_positions
from distframe.compile_support import is_compiled_module
from distframe.errors import ConfigError


class LMEmbedding(nn.Module):
    """First layer of the LM: ``tokens (B, T) -> tok_embedding + pos_embedding (B, T, E)``."""

    def __init__(self, tok_embedding: nn.Module, pos_embedding: nn.Module) -> None:
        super().__init__()
        self.tok_embedding, self.pos_embedding = tok_embedding, pos_embedding
        self.sequence_shard = (0, 1)  # as DilatedTransformerLM.sequence_shard

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = shard_positions(tokens, self.sequence_shard, self.pos_embedding.num_embeddings)
        return self.tok_embedding(tokens) + self.pos_embedding(positions)


class LMHead(nn.Module):
    """Last layer of the LM: ``(B, T, E) -> head(final_norm(x)) (B, T, V)``."""

    def __init__(self, final_norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.final_norm, self.head = final_norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(x))


def _is_lm(model: object) -> bool:
    return all(hasattr(model, a) for a in ("tok_embedding", "pos_embedding", "blocks", "final_norm", "head"))


def pipeline_layers(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``[(qualified name prefix, layer)]`` in execution order (see the module docstring)."""
    if hasattr(model, "pipeline_layers"):  # the model says (before its Sequential or LM base would)
        return _without_repeats(list(model.pipeline_layers()))
    _refuse_own_forward(model)
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        # _modules, not named_children(), which skips a module listed twice: Sequential runs both
        return _without_repeats([(name, child) for name, child in model._modules.items()])
    if isinstance(model, (list, tuple)):
        if not all(isinstance(m, nn.Module) for m in model):
            raise ConfigError("a list to split into stages must hold nn.Module blocks only")
        return _without_repeats([(str(i), m) for i, m in enumerate(model)])
    if _is_lm(model):
        layers = [("", LMEmbedding(model.tok_embedding, model.pos_embedding))]
        layers += [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        return layers + [("", LMHead(model.final_norm, model.head))]
    if is_compiled_module(model):
        raise ConfigError("cannot split a torch.compile'd module into pipeline stages: its blocks run "
                          "inside one compiled forward. Pass the module itself and compile its blocks "
                          "in place (for block in model: block.compile()), or compile the "
                          "PipelineParallelModel")
    raise ConfigError(f"cannot split {type(model).__name__} into pipeline stages: pass an "
                      "nn.Sequential, a list of blocks, a DilatedTransformerLM, or a module with a "
                      "pipeline_layers() method returning [(name, module), ...]")


def _refuse_own_forward(model: object) -> None:
    """ConfigError for an nn.Sequential or DilatedTransformerLM subclass with a forward of its own:
    its stages run the layers in order (or the LM's embedding, blocks and head), never that
    forward, so the pipeline would compute another function without a word."""
    from attention.model import DilatedTransformerLM
    for base in (nn.Sequential, DilatedTransformerLM):
        if isinstance(model, base) and any(getattr(type(model), name) is not getattr(base, name)
                                           for name in ("forward", "embed") if hasattr(base, name)):
            raise ConfigError(
                f"{type(model).__name__} overrides {base.__name__}'s forward, which a pipeline would "
                "not run (its stages run the layers in order); give it a pipeline_layers() method "
                "returning [(name, module), ...] whose modules, run in order, compute that forward")


def _without_repeats(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """ConfigError when one module is two of the layers: a pipeline gives each layer to one stage."""
    seen: dict[int, str] = {}
    for name, layer in layers:
        if id(layer) in seen:
            raise ConfigError(
                f"layer {name!r} is the same module as layer {seen[id(layer)]!r}; a pipeline gives each "
                "layer to one stage, so the module cannot run in both places: make the module that "
                "uses it twice one layer (a small nn.Module calling it twice)")
        seen[id(layer)] = name
    return layers


def layer_parameter_counts(layers: Sequence[tuple[str, nn.Module]]) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for _, layer in layers]


def partition(counts: Sequence[int], num_stages: int,
              split_points: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage, each non-empty.

    With ``split_points`` (``num_stages - 1`` increasing layer indices) the stages start there;
    otherwise the cut minimises the largest stage's parameter count (ties: earlier cuts).
    """
    n = len(counts)
    if num_stages < 1:
        raise ConfigError(f"num_stages must be positive, got {num_stages}")
    if n < num_stages:
        raise ConfigError(f"the model has {n} layers to split but {num_stages} pipeline stages were "
                          f"asked for; use at most {n} stages (pp <= {n})")
    if split_points is not None:
        points = _layer_indices(split_points, num_stages)
        if len(points) != num_stages - 1 or points != sorted(set(points)) or \
                (points and (points[0] < 1 or points[-1] > n - 1)):
            raise ConfigError(f"split_points={points!r}: give {num_stages - 1} increasing layer "
                              f"indices in 1..{n - 1} (where stages 1..{num_stages - 1} begin)")
        bounds = [0, *points, n]
        return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    return _balanced(list(counts), num_stages)


def _layer_indices(split_points: object, num_stages: int) -> list[int]:
    """``split_points`` as a list of ints (NumPy and torch integers too); ConfigError otherwise,
    where ``range`` or ``sorted`` would raise a TypeError that does not name the setting."""
    fix = f"give a list of {num_stages - 1} increasing layer indices (ints)"
    if isinstance(split_points, (str, bytes)) or not hasattr(split_points, "__iter__"):
        raise ConfigError(f"split_points={split_points!r}: {fix}")
    items, points = list(split_points), []
    for point in items:
        try:
            points.append(operator.index(point) if not isinstance(point, bool) else None)
        except TypeError:  # a float, or a tensor of floats
            points.append(None)
        if points[-1] is None:
            raise ConfigError(f"split_points={items!r}: {point!r} is not an int; {fix}")
    return points


def _balanced(counts: list[int], num_stages: int) -> list[range]:
    # best[k][i]: (largest stage, sum of squared stage sizes) when layers[:i] form k stages; the
    # second key breaks ties between cuts with the same largest stage towards even stages.
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    worst = (float("inf"), float("inf"))
    best = [[worst] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                size = prefix[i] - prefix[j]
                value = (max(best[k - 1][j][0], size), best[k - 1][j][1] + size * size)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(num_stages)]


class PipelineStage(nn.Module):
    """The layers of one stage, run in order: ``x -> layers[-1](...layers[0](x))``."""

    def __init__(self, layers: Sequence[nn.Module], index: int, num_stages: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.index, self.num_stages = index, num_stages

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def split_into_stages(model: nn.Module | Sequence[nn.Module], num_stages: int,
                      split_points: Sequence[int] | None = None) -> list[PipelineStage]:
    """Every stage of ``model`` (sharing its modules, not copies)."""
    layers = pipeline_layers(model)
    ranges = partition(layer_parameter_counts(layers), num_stages, split_points)
    return [PipelineStage([layers[i][1] for i in r], s, num_stages) for s, r in enumerate(ranges)]
