"""What GradientCompressionOptimizer checks of its compressor: the signature of ``compress`` and
what it returns; that every rank compresses alike (``agreed_settings``): ranks with another
compressor, ratio, seed or error feedback exchanged payloads that do not fit together, or (error
feedback on one rank only, a rate per rank) replicas that drifted apart without a word; and that
a compressor with state serves one rank (``claim``)."""
from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.optimizers.agreed_settings import check_same_settings, optimizer_settings
from distframe.optimizers.compression import Compressor


def check_compress_signature(compressor: Compressor) -> None:
    """ConfigError unless ``compressor.compress`` takes the ``key`` keyword it is called with."""
    parameters = inspect.signature(compressor.compress).parameters.values()
    if not any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ConfigError(
            f"{type(compressor).__name__}.compress takes no key= argument; define it as "
            "compress(self, tensor, *, key=None) -> (payload, ctx): key names the parameter, so a "
            "compressor with state (a warm start) keeps it per parameter (ignore it otherwise)")


def check_compress_result(compressor: Compressor, result: Any) -> tuple[Any, Any]:
    """``result`` of ``compressor.compress``; ConfigError unless it is (a tuple of tensors, ctx)."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple)
            and all(isinstance(t, torch.Tensor) for t in result[0])):
        raise ConfigError(
            f"{type(compressor).__name__}.compress must return (payload, ctx) with payload a "
            f"tuple of tensors (the wire parts), e.g. ((values,), shape); got {_describe(result)}")
    return result


def _describe(result: Any) -> str:
    if isinstance(result, tuple):
        return "(" + ", ".join(type(part).__name__ for part in result) + ")"
    return type(result).__name__


def check_same_compression(backend: ICommunicationBackend, optimizer: Any, compressor: Compressor,
                           error_feedback: bool, owner: str) -> None:
    """ConfigError on every rank unless every rank built the optimizer (class, param groups) and
    the compressor (its repr and ``seed``: PowerSGD's first factors and int8's rounding noise
    derive from it) alike, with the same effective error feedback; one all_gather."""
    check_same_settings(backend, {**optimizer_settings(optimizer), "compressor": repr(compressor),
                                  "compressor_seed": getattr(compressor, "seed", None),
                                  "error_feedback": error_feedback}, owner)


def claim(compressor: Compressor, backend: ICommunicationBackend) -> None:
    """A compressor with state of its own (``state_dict``: int8's rounding generator, PowerSGD's
    warm start) serves one rank. In-memory ranks are threads of one process, so one object built
    outside ``spawn``'s function reached every rank, which then raced on its state and drew the
    same rounding noise: results silently off. Stateless compressors may be shared. A compressor
    whose rank has shut its backend down (an earlier run) may serve again."""
    if type(compressor).state_dict is Compressor.state_dict:
        return
    holder = compressor.__dict__.get("_holder")
    other = holder() if holder is not None else None
    if (other is not None and other is not backend and other.rank != backend.rank
            and not getattr(other, "is_shut_down", False)):
        raise ConfigError(
            f"this {type(compressor).__name__} already serves rank {other.rank}'s "
            f"GradientCompressionOptimizer: it keeps per-rank state, so give rank {backend.rank} its "
            "own (build it inside the function each rank runs, or copy.deepcopy(compressor))")
    compressor._holder = weakref.ref(backend)
