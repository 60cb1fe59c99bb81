"""Torch functions that draw from torch's global generator, which the first forward of a
tensor-parallel stage refuses outside distframe's split-aware layers (see [Note: draws from the
global generator] in ``tensor_parallel_mixing``): which calls draw, and the ConfigError that says
what to use instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from distframe.errors import ConfigError


class _Dropout(NamedTuple):
    """Where a dropout-like op takes its probability and its training flag: it draws nothing at
    ``p == 0`` or outside training. ``p_at`` None: no probability (it draws when training);
    ``training_at`` None: no flag (it draws whenever ``p > 0``)."""
    p_at: int | None
    p_default: float
    training_at: int | None
    training_default: bool


# op -> how it draws; None: on every call.
DRAWS: dict[str, _Dropout | None] = {name: _Dropout(1, 0.5, 2, True) for name in (
    "dropout", "dropout1d", "dropout2d", "dropout3d", "native_dropout")}
DRAWS.update({"alpha_dropout": _Dropout(1, 0.5, 2, False),
              "feature_alpha_dropout": _Dropout(1, 0.5, 2, False),
              "rrelu": _Dropout(None, 1.0, 3, False),
              # Attention with a dropout of its own, which takes no generator. nn.MultiheadAttention
              # calls the second: the dropout inside it is never seen, as the mode sees only the
              # outermost torch function.
              "scaled_dot_product_attention": _Dropout(4, 0.0, None, True),
              "multi_head_attention_forward": _Dropout(10, 0.0, 13, True)})
DRAWS.update({name: None for name in (
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "randperm", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "random_", "multinomial", "poisson", "gumbel_softmax")})

_WHY = ("draws from torch's global generator: under tensor parallelism each tensor rank would draw "
        "differently where its activations are replicated (in-memory ranks share that generator; process "
        "ranks are seeded apart or alike), and the ranks' replicated parameters would drift apart. ")
_SPLIT_ATTENTION = ("or use attention.MultiheadDilatedAttention split by heads (plan its q_proj, k_proj, "
                    "v_proj 'column' and out_proj 'row'), whose attention dropout draws per tensor rank")


def attention_names(chunks: Sequence[nn.Module]) -> dict[int, str]:
    """``id(out_proj.weight) -> name`` of each ``nn.MultiheadAttention`` of ``chunks``, which names
    the module in the error for its dropout (its forward passes that weight)."""
    return {id(m.out_proj.weight): name for chunk in chunks for name, m in chunk.named_modules()
            if isinstance(m, nn.MultiheadAttention)}


def draws_from_global(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``op`` (one of ``DRAWS``) draws, from torch's global generator."""
    if kwargs.get("generator") is not None:
        return False
    spec = DRAWS[op]
    if spec is None:
        return True
    return _training(spec, args, kwargs) and _probability(spec, args, kwargs) != 0


def _probability(spec: _Dropout, args: tuple, kwargs: dict) -> Any:
    positional = args[spec.p_at] if spec.p_at is not None and len(args) > spec.p_at else spec.p_default
    return kwargs.get("p", kwargs.get("dropout_p", positional))


def _training(spec: _Dropout, args: tuple, kwargs: dict) -> bool:
    if spec.training_at is None:
        return True
    positional = args[spec.training_at] if len(args) > spec.training_at else spec.training_default
    return bool(kwargs.get("training", kwargs.get("train", positional)))


def global_draw_error(op: str, args: tuple, kwargs: dict, attentions: dict[int, str]) -> ConfigError:
    """The ConfigError for a call of ``op`` that draws (``attentions``: from ``attention_names``)."""
    if op == "multi_head_attention_forward":
        out_proj_weight = args[11] if len(args) > 11 else kwargs.get("out_proj_weight")
        name = attentions.get(id(out_proj_weight))
        module = "an nn.MultiheadAttention" if name is None else f"nn.MultiheadAttention {name!r}"
        return ConfigError(
            f"the model's forward calls {module} with dropout={_probability(DRAWS[op], args, kwargs)}, whose "
            f"attention dropout {_WHY}It takes no generator: set its dropout to 0 "
            f"({name or 'attention'}.dropout = 0.0; nn.TransformerEncoderLayer hands its dropout to its "
            f"self_attn), {_SPLIT_ATTENTION}")
    if op == "scaled_dot_product_attention":
        return ConfigError(
            f"the model's forward calls {op!r} with dropout_p={_probability(DRAWS[op], args, kwargs)}, which "
            f"{_WHY}It takes no generator: call it with dropout_p=0 under tensor parallelism, in "
            f"training as well, {_SPLIT_ATTENTION}")
    return ConfigError(
        f"the model's forward calls {op!r}, which {_WHY}Use an nn.Dropout module instead of F.dropout "
        "(distframe draws its mask alike on every tensor rank), pass the op a generator of your own, "
        "seeded alike on the tensor ranks, or p=0")
