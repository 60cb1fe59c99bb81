"""What GradientCompressionOptimizer checks of its compressor: the signature of ``compress``, and
that every rank compresses alike (``agreed_settings``): ranks with another compressor, ratio,
seed or error feedback exchanged payloads that do not fit together, or (error feedback on one
rank only, a rate per rank) replicas that drifted apart without a word."""
from __future__ import annotations

import inspect
from typing import Any

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


def check_same_compression(backend: ICommunicationBackend, optimizer: Any, compressor: Compressor,
                           error_feedback: bool, owner: str) -> None:
    """ConfigError on every rank unless every rank built the optimizer (class, param groups) and
    the compressor (its repr and ``seed``: PowerSGD's first factors and int8's rounding noise
    derive from it) alike, with the same effective error feedback; one all_gather."""
    check_same_settings(backend, {**optimizer_settings(optimizer), "compressor": repr(compressor),
                                  "compressor_seed": getattr(compressor, "seed", None),
                                  "error_feedback": error_feedback}, owner)
