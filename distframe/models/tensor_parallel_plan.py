"""Applying a tensor-parallel plan (module name -> ``"column"``, ``"row"`` or ``"vocab"``) to a model.

Parallelism is applied from outside, as torchtitan does: the planned ``nn.Linear`` and
``nn.Embedding`` submodules are replaced, in place, by the layers of ``tensor_parallel``; the
parameter names stay the dense model's. Rules:

* ``"vocab"`` on an ``nn.Embedding``: VocabParallelEmbedding.
* ``"column"`` on an ``nn.Linear``: ColumnParallelLinear. Its output stays split when a ``"row"``
  layer takes it (the MLP's ``fc_in -> fc_out``); otherwise it is gathered, so the module computes
  what the dense one did (the LM head). In an ``nn.Sequential`` the order says which: a column
  pairs with the next planned layer if that is a row and only activations and dropouts lie
  between (a softmax or a norm there keeps them apart). Elsewhere a column pairs with any sibling
  (same parent module) planned ``"row"`` (a gated MLP's two columns feed one row); a split output
  that reaches the model's output anyway is a ConfigError at the first forward
  (``tensor_parallel_flow``), and so is an op along the split features between a column and its
  row (``tensor_parallel_mixing``).
* ``"row"``: RowParallelLinear; its input is split first unless it pairs with a column.
* ``q_proj``, ``k_proj``, ``v_proj`` ``"column"`` and ``out_proj`` ``"row"`` of a
  ``MultiheadDilatedAttention``: the whole attention is replaced by
  TensorParallelDilatedAttention (split by heads, one ``f`` for q/k/v).
* A planned layer is a plain ``nn.Linear`` / ``nn.Embedding``: a subclass with its own forward,
  parameters, buffers or submodules, or a parametrized one (weight_norm), is a ConfigError (the
  split layer would drop them); one that changes only its ``__init__`` is split.
* A planned layer is replaced under every name it is registered by (``self.alias = self.up``);
  either name may be planned. A parent that reads its children's weights itself cannot take a
  split layer: ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) is a ConfigError;
  an ``nn.TransformerEncoderLayer`` is kept off its fused inference path (``_keep_off_fused_paths``).
* A replicated value the split region uses (a PReLU weight between a column and its row) gets
  its gradient summed over the group (``tensor_parallel_region``).

A weight tied between planned layers (the LM's embedding and head) stays one Parameter. Given a
TensorParallelRNG (``tensor_parallel_rng``), every ``nn.Dropout`` becomes a ReplicatedDropout (the
same mask on each tensor rank) and a split attention's dropout draws per rank.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from torch import nn
from torch.nn.utils import parametrize

from attention.multihead import MultiheadDilatedAttention
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.replaced_modules import refuse_hooked
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
    places = _places(model)
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
                parallel = _parallel_attention(parent_name, parent, children, backend, shared, rng)
            _replace(model, places, parent, parallel)
            _record(origins, parent, parallel)
            continue
        paired = _paired(parent, children)
        for child, style in mine.items():
            dense = parent.get_submodule(child)
            name = f"{parent_name}.{child}" if parent_name else child
            with _naming(name):
                layer = _parallel_layer(dense, style, paired[child], backend, shared, name)
            layer.plan_name = name  # named in its wiring errors
            _replace(model, places, dense, layer)
            _record(origins, dense, layer)
    _keep_off_fused_paths(model)
    return origins


def _places(model: nn.Module) -> dict[int, list[str]]:
    """``id(module) -> every name it is registered under`` (``self.alias = self.up``: two)."""
    places: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        places.setdefault(id(module), []).append(name)
    return places


def _replace(model: nn.Module, places: dict[int, list[str]], dense: nn.Module, parallel: nn.Module) -> None:
    """Puts ``parallel`` in ``dense``'s place under each of its names: an alias left holding the
    dense module would compute with the full weights, which no longer train."""
    refuse_hooked(dense, places[id(dense)][0], "tensor parallelism")  # [Note: hooks on replaced modules]
    for name in places[id(dense)]:
        owner_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, parallel)


def _keep_off_fused_paths(model: nn.Module) -> None:
    """torch's fused inference path of an nn.TransformerEncoderLayer (eval, no grad) passes its
    linear1/linear2 weights to one kernel, bypassing the split layers' forwards: with slices of
    them it computes another model, silently. ``activation_relu_or_gelu`` (0: an activation the
    kernel does not fuse) only chooses that path, so 0 keeps the layer on its module-by-module
    forward; an nn.TransformerEncoder holding such a layer does not turn a padded batch into a
    nested tensor either (what its constructor does for such a layer): it computes the padded
    positions rather than zeroing them, as it does with grad enabled."""
    for module in model.modules():
        parallel = any(isinstance(child, (ColumnParallelLinear, RowParallelLinear))
                       for child in module.children())
        if isinstance(module, nn.TransformerEncoderLayer) and parallel:
            module.activation_relu_or_gelu = 0
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
                getattr(layer, "activation_relu_or_gelu", 1) == 0 for layer in module.layers):
            module.use_nested_tensor = False


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
    """The plan, validated, with each planned module under its first name (``named_modules()``'s):
    a module registered under two names (``self.alias = self.up``) may be planned by either."""
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError("plan must be a non-empty dict {'module.name': 'column' | 'row' | 'vocab'}")
    names = dict(model.named_modules(remove_duplicate=False))
    first = {id(module): name for name, module in model.named_modules()}
    canonical: dict[str, str] = {}
    for name, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"plan[{name!r}]={style!r}: choose one of {', '.join(STYLES)}")
        if name not in names:
            raise ConfigError(f"plan names {name!r}, which is not a submodule of {type(model).__name__}")
        if name == "":  # the model itself: a layer cannot be put in its own place
            raise ConfigError(f"plan names the model itself (''): plan its submodules; a lone layer "
                              f"goes in a container first, e.g. nn.Sequential(layer) with plan "
                              f"{{'0': {style!r}}}")
        wanted = nn.Embedding if style == "vocab" else nn.Linear
        if not isinstance(names[name], wanted):
            raise ConfigError(f"plan[{name!r}]={style!r} needs an nn.{wanted.__name__}, "
                              f"got {type(names[name]).__name__}")
        _check_plain(names[name], name, wanted)
        _check_parent(names, name)
        known = first[id(names[name])]
        if canonical.get(known, style) != style:
            other = next(n for n in plan if first[id(names[n])] == known and n != name)
            raise ConfigError(f"{other!r} and {name!r} name one module (registered under both names), "
                              f"planned {plan[other]!r} and {style!r}: plan it once")
        canonical[known] = style
    _check_ties(model, names, canonical)
    return canonical


def _check_plain(module: nn.Module, name: str, wanted: type[nn.Module]) -> None:
    """ConfigError for a planned layer that computes more than a plain ``wanted``: the split layer
    takes only its weight (and bias) and computes ``wanted``'s forward, so a parametrization of the
    weight, a subclass's own forward and its other parameters, buffers and submodules would be
    dropped, silently. A subclass that changes only its ``__init__`` (its initialisation) is split."""
    if parametrize.is_parametrized(module):
        raise ConfigError(
            f"plan[{name!r}]: {name!r} is parametrized ({', '.join(module.parametrizations)}: "
            "torch.nn.utils.parametrize, e.g. weight_norm), and parametrizations cannot be split: "
            "the split layer would hold a slice of the original tensors and drop the parametrization. "
            f"Call torch.nn.utils.parametrize.remove_parametrizations(layer, "
            f"{next(iter(module.parametrizations))!r}) on it before wrapping (the weight keeps its "
            "current value), or leave it out of the plan")
    kept = ("weight", "bias") if wanted is nn.Linear else ("weight",)
    dropped = ["its own forward"] if type(module).forward is not wanted.forward else []
    dropped += [f"its parameter {n!r}" for n, _ in module.named_parameters(recurse=False) if n not in kept]
    dropped += [f"its buffer {n!r}" for n, _ in module.named_buffers(recurse=False)]
    dropped += [f"its submodule {n!r}" for n, _ in module.named_children()]
    if dropped:
        what = dropped[0] if len(dropped) == 1 else f"{', '.join(dropped[:-1])} and {dropped[-1]}"
        raise ConfigError(
            f"plan[{name!r}]: its class {type(module).__name__} subclasses nn.{wanted.__name__}, but "
            f"the split layer computes a plain nn.{wanted.__name__}'s forward: {what} would be "
            f"dropped. Plan a plain nn.{wanted.__name__} (moving the rest into its parent module's "
            "forward), or leave it out of the plan")


def _check_parent(names: dict[str, nn.Module], name: str) -> None:
    """ConfigError for a planned layer whose parent reads its weight itself (see the note on
    parents in the module docstring's rules)."""
    parent_name = name.rpartition(".")[0]
    if isinstance(names[parent_name], nn.MultiheadAttention):
        raise ConfigError(
            f"plan[{name!r}]: {parent_name or 'the model'!r} is an nn.MultiheadAttention, whose forward "
            "reads its projections' weights itself (F.multi_head_attention_forward), so a split "
            f"{name.rpartition('.')[2]} would compute with one rank's slice; leave it out of the plan "
            "(the attention stays replicated), or build the model with "
            "attention.MultiheadDilatedAttention and plan its q_proj, k_proj, v_proj 'column' and "
            "out_proj 'row' (split by heads)")


def _check_ties(model: nn.Module, names: dict[str, nn.Module], plan: dict[str, str]) -> None:
    # A weight tied between a planned layer and another module would be split on one side only,
    # silently untying them: both must be planned (split the same way) or neither.
    planned_modules = {id(names[name]) for name in plan}
    planned = {id(p): name for name in plan for p in names[name].parameters()}
    for alias, param in model.named_parameters(remove_duplicate=False):
        owner = alias.rpartition(".")[0]
        if id(param) in planned and id(names[owner]) not in planned_modules:
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


def _paired(parent: nn.Module, children: dict[str, str]) -> dict[str, bool]:
    """Planned child -> whether it pairs with a partner (see the module docstring): a column's
    output then stays split, a row's input arrives split."""
    if isinstance(parent, nn.Sequential):
        # A column pairs with the next planned layer if that is a row and what lies between them
        # acts on each feature by itself, holding no parameters (an activation, a dropout): a
        # layer with weights would get the split, and a softmax or a norm would work on a slice.
        every = list(parent.named_children())
        order = [(i, name) for i, (name, _) in enumerate(every) if name in children]
        pairs = [(a, b) for (i, a), (j, b) in zip(order, order[1:])
                 if (children[a], children[b]) == ("column", "row")
                 and all(_per_feature(m) for _, m in every[i + 1:j])]
        in_pair = {name for pair in pairs for name in pair}
        return {child: child in in_pair for child in children}
    styles = set(children.values())
    partner = {"column": "row", "row": "column"}
    return {child: partner.get(style) in styles for child, style in children.items()}


# Parameter-free modules that act on each element by itself (RReLU draws per element: not here).
_PER_FEATURE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.ELU, nn.CELU,
                nn.SELU, nn.LeakyReLU, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Hardtanh,
                nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink, nn.Softshrink, nn.Threshold,
                nn.LogSigmoid, nn.Identity, nn.Dropout)


def _per_feature(module: nn.Module) -> bool:
    return isinstance(module, _PER_FEATURE) and not any(True for _ in module.parameters())


def _parallel_layer(dense: nn.Module, style: str, paired: bool, backend: ICommunicationBackend,
                    shared: dict, name: str) -> nn.Module:
    if style == "vocab":
        return VocabParallelEmbedding.from_dense(dense, backend, shared=shared)
    if style == "column":
        return ColumnParallelLinear.from_dense(dense, backend, gather_output=not paired, shared=shared)
    if style == "row":
        return RowParallelLinear.from_dense(dense, backend, input_is_parallel=paired, shared=shared)
    raise ConfigError(f"plan[{name!r}]={style!r}: choose one of {', '.join(STYLES)}")


def _parallel_attention(name: str, attention: MultiheadDilatedAttention, children: dict[str, str],
                        backend: ICommunicationBackend, shared: dict,
                        rng: TensorParallelRNG | None) -> TensorParallelDilatedAttention:
    if children != _ATTENTION_PLAN:
        raise ConfigError(f"attention {name!r}: plan q_proj, k_proj, v_proj as 'column' and out_proj "
                          f"as 'row' (it is split by heads), got {children}")
    if not name:
        raise ConfigError("plan the attention's projections inside a model, not a bare attention module")
    return TensorParallelDilatedAttention(attention, backend, shared, rng)
