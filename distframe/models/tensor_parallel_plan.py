"""Applying a tensor-parallel plan (module name -> ``"column"``, ``"row"`` or ``"vocab"``) to a model.

Parallelism is applied from outside, as torchtitan does: the planned ``nn.Linear`` and
``nn.Embedding`` submodules are replaced, in place, by the layers of ``tensor_parallel``; the
parameter names stay the dense model's. Rules:

* ``"vocab"`` on an ``nn.Embedding``: VocabParallelEmbedding.
* ``"column"`` on an ``nn.Linear``: ColumnParallelLinear. Its output stays split when a ``"row"``
  layer takes it (the MLP's ``fc_in -> fc_out``); otherwise it is gathered, so the module computes
  what the dense one did (the LM head). In an ``nn.Sequential`` the order says which: a column
  pairs with the next planned layer if that is a row. Elsewhere a column pairs with any sibling
  (same parent module) planned ``"row"`` (a gated MLP's two columns feed one row); a split output
  that reaches the model's output anyway is a ConfigError at the first forward
  (``tensor_parallel_flow``).
* ``"row"``: RowParallelLinear; its input is split first unless it pairs with a column.
* ``q_proj``, ``k_proj``, ``v_proj`` ``"column"`` and ``out_proj`` ``"row"`` of a
  ``MultiheadDilatedAttention``: the whole attention is replaced by
  TensorParallelDilatedAttention (split by heads, one ``f`` for q/k/v).

A weight tied between planned layers (the LM's embedding and head) stays one Parameter. Given a
TensorParallelRNG (``tensor_parallel_rng``), every ``nn.Dropout`` becomes a ReplicatedDropout (the
same mask on each tensor rank) and a split attention's dropout draws per rank.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from torch import nn

from attention.multihead import MultiheadDilatedAttention
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              ShardedLayerNorm, VocabParallelEmbedding)
from distframe.models.tensor_parallel_attention import TensorParallelDilatedAttention
from distframe.models.tensor_parallel_rng import TensorParallelRNG, replace_dropouts

STYLES = ("column", "row", "vocab")
_ATTENTION_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "out_proj": "row"}


def default_tp_plan(model: nn.Module) -> dict[str, str]:
    """The Megatron plan of a DilatedTransformerLM: vocab-parallel embedding and (gathered) head,
    attention split by heads, MLP split column-then-row; norms and positions replicated."""
    if not all(hasattr(model, a) for a in ("tok_embedding", "blocks", "head")):
        raise ConfigError(f"no default tensor-parallel plan for {type(model).__name__}; pass "
                          "plan={'module.name': 'column' | 'row' | 'vocab', ...}")
    plan = {"tok_embedding": "vocab", "head": "column"}
    for i, block in enumerate(model.blocks):
        for proj, style in _ATTENTION_PLAN.items():
            plan[f"blocks.{i}.attn.{proj}"] = style
        plan[f"blocks.{i}.mlp.fc_in"] = "column"
        plan[f"blocks.{i}.mlp.fc_out"] = "row"
    return plan


def apply_tensor_parallel(model: nn.Module, backend: ICommunicationBackend, plan: Mapping[str, str],
                          *, include: Callable[[nn.Module], bool] | None = None,
                          rng: TensorParallelRNG | None = None) -> dict[int, int]:
    """Replaces the planned submodules of ``model`` in place (see the module docstring).

    ``include(module)`` limits the plan to some modules (a pipeline stage's); ``None``: all.
    ``rng``: this rank's dropout generators; None leaves dropout on torch's global generator,
    which only ranks in separate processes seeded alike keep consistent.
    Returns ``{id(new parameter): id(the dense parameter it was cut from)}``.
    """
    plan = _checked(model, plan)
    if rng is not None:
        replace_dropouts(model, rng, include)
    shared: dict = {}
    origins: dict[int, int] = {}
    by_parent: dict[str, dict[str, str]] = {}
    for name, style in plan.items():
        parent, _, child = name.rpartition(".")
        by_parent.setdefault(parent, {})[child] = style
    for parent_name, children in by_parent.items():
        parent = model.get_submodule(parent_name) if parent_name else model
        # A pipeline stage may hold only some of a parent's planned children (the LM's embedding
        # and head): it splits those. Whether a column's output stays split follows from the
        # whole plan, so the stages agree on what crosses between them.
        mine = {c: s for c, s in children.items() if include is None or include(parent.get_submodule(c))}
        if not mine:
            continue
        if isinstance(parent, MultiheadDilatedAttention):
            with _naming(parent_name or type(parent).__name__):
                parallel = _replace_attention(model, parent_name, parent, children, backend, shared, rng)
            _record(origins, parent, parallel)
            continue
        paired = _paired(parent, children)
        for child, style in mine.items():
            dense = parent.get_submodule(child)
            name = f"{parent_name}.{child}" if parent_name else child
            with _naming(name):
                layer = _parallel_layer(dense, style, paired[child], backend, shared, name)
            layer.plan_name = name  # named in its wiring errors
            setattr(parent, child, layer)
            _record(origins, dense, layer)
    return origins


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """A ConfigError of the layers (a size tp does not divide) names the planned module: in a
    plan of many layers, 'out_features (5)' alone does not say which one to change."""
    try:
        yield
    except ConfigError as error:
        message = str(error)
        raise (error if repr(name) in message else ConfigError(f"{name!r}: {message}")) from None


def _record(origins: dict[int, int], dense: nn.Module, parallel: nn.Module) -> None:
    # The parallel layers keep the dense modules' parameter names (weight, q_proj.weight, ...).
    dense_params = dict(dense.named_parameters())
    for name, param in parallel.named_parameters():
        origins[id(param)] = id(dense_params[name])


def split_dims(model: nn.Module) -> dict[int, int]:
    """``id(parameter) -> dim`` along which each tensor-parallel parameter of ``model`` is split."""
    out: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding, ShardedLayerNorm)):
            for p in (module.weight, getattr(module, "bias", None)):
                if p is not None:
                    out[id(p)] = 0
        elif isinstance(module, RowParallelLinear):
            out[id(module.weight)] = 1
    return out


def _checked(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError("plan must be a non-empty dict {'module.name': 'column' | 'row' | 'vocab'}")
    names = dict(model.named_modules())
    for name, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"plan[{name!r}]={style!r}: choose one of {', '.join(STYLES)}")
        if name not in names:
            raise ConfigError(f"plan names {name!r}, which is not a submodule of {type(model).__name__}")
        wanted = nn.Embedding if style == "vocab" else nn.Linear
        if not isinstance(names[name], wanted):
            raise ConfigError(f"plan[{name!r}]={style!r} needs an nn.{wanted.__name__}, "
                              f"got {type(names[name]).__name__}")
    # A weight tied between a planned layer and another module would be split on one side only,
    # silently untying them: both must be planned (split the same way) or neither.
    planned = {id(p): name for name in plan for p in names[name].parameters()}
    for alias, param in model.named_parameters(remove_duplicate=False):
        owner = alias.rpartition(".")[0]
        if id(param) in planned and owner not in plan:
            raise ConfigError(f"{alias} is tied to {planned[id(param)]}, which the plan splits; plan "
                              f"{owner!r} too (a tied embedding 'vocab' with its head 'column') or neither")
    # ... and split along one dim: checked here, on the whole model, because pipeline stages
    # apply the plan one stage at a time and each sees only its own side of a tie.
    split_dim: dict[int, tuple[int, str]] = {}
    for name, style in plan.items():
        dim, weight = (1 if style == "row" else 0), names[name].weight
        other = split_dim.setdefault(id(weight), (dim, name))
        if other[0] != dim:
            raise ConfigError(f"{name!r} ({style}) and {other[1]!r} ({plan[other[1]]}) share a weight that "
                              "they would split along different dims; plan a tied embedding 'vocab' with "
                              "its head 'column'")
    return dict(plan)


def _paired(parent: nn.Module, children: dict[str, str]) -> dict[str, bool]:
    """Planned child -> whether it pairs with a partner (see the module docstring): a column's
    output then stays split, a row's input arrives split."""
    if isinstance(parent, nn.Sequential):
        # A column pairs with the next planned layer if that is a row and nothing between them
        # holds parameters (an activation, a dropout): a layer with weights would get the split.
        every = list(parent.named_children())
        order = [(i, name) for i, (name, _) in enumerate(every) if name in children]
        pairs = [(a, b) for (i, a), (j, b) in zip(order, order[1:])
                 if (children[a], children[b]) == ("column", "row")
                 and not any(any(True for _ in m.parameters()) for _, m in every[i + 1:j])]
        in_pair = {name for pair in pairs for name in pair}
        return {child: child in in_pair for child in children}
    styles = set(children.values())
    return {child: {"column": "row", "row": "column"}.get(style) in styles for child, style in children.items()}


def _parallel_layer(dense: nn.Module, style: str, paired: bool, backend: ICommunicationBackend,
                    shared: dict, name: str) -> nn.Module:
    if style == "vocab":
        return VocabParallelEmbedding.from_dense(dense, backend, shared=shared)
    if style == "column":
        return ColumnParallelLinear.from_dense(dense, backend, gather_output=not paired, shared=shared)
    if style == "row":
        return RowParallelLinear.from_dense(dense, backend, input_is_parallel=paired, shared=shared)
    raise ConfigError(f"plan[{name!r}]={style!r}: choose one of {', '.join(STYLES)}")


def _replace_attention(model: nn.Module, name: str, attention: MultiheadDilatedAttention,
                       children: dict[str, str], backend: ICommunicationBackend, shared: dict,
                       rng: TensorParallelRNG | None) -> TensorParallelDilatedAttention:
    if children != _ATTENTION_PLAN:
        raise ConfigError(f"attention {name!r}: plan q_proj, k_proj, v_proj as 'column' and out_proj "
                          f"as 'row' (it is split by heads), got {children}")
    if not name:
        raise ConfigError("plan the attention's projections inside a model, not a bare attention module")
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    parallel = TensorParallelDilatedAttention(attention, backend, shared, rng)
    setattr(owner, attr, parallel)
    return parallel
