"""Settings every rank must build alike, compared at construction by one all_gather.

Ranks that apply one averaged gradient stay replicas only if they apply it alike: an optimizer
built with lr 0.1 on one rank and 0.2 on another, or with error feedback on one rank alone, ran
without a word while its replicas drifted apart; an AsyncSGDOptimizer worker built with another
rate or staleness bound than its server's ran as if its settings counted. Comparing costs one
all_gather of an int64 digest of each rank's settings (their JSON, keys sorted); only when the
digests differ does a second exchange, of the JSON itself, find what differs, so every rank
raises the same ConfigError, naming each setting that differs and which ranks hold which value.

Tensor settings (a tensor lr, as capturable optimizers take) are compared by value
(``sharded_state.hyperparameters``); what JSON cannot hold is compared by its ``repr``.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from distframe.backends.objects import all_gather_bytes
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.replicas import fingerprint
from distframe.optimizers.sharded_state import hyperparameters

__all__ = ["check_same_settings", "optimizer_settings"]

_SHOWN = 3  # settings named in the message; the rest are counted
_NOT_SET = "(not set)"


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The wrapped optimizer's class and each param group's settings (lr, betas, ...)."""
    return {"optimizer": type(optimizer).__name__, "param_groups": hyperparameters(optimizer)}


def check_same_settings(backend: ICommunicationBackend, settings: dict[str, Any], owner: str,
                        fix: str = "build it with the same settings on every rank") -> None:
    """ConfigError on every rank of ``backend`` unless every rank passed the same ``settings``
    (nested dicts and lists of dicts, as param groups, are compared entry by entry); collective."""
    text = json.dumps(_flattened(settings), sort_keys=True, default=repr)
    digests = backend.all_gather(torch.tensor([fingerprint(text)], dtype=torch.int64))
    if bool((digests == digests[0]).all()):
        return
    every = [json.loads(blob) for blob in all_gather_bytes(backend, text.encode())]
    keys = sorted(set().union(*every))
    differing = [key for key in keys if len({json.dumps(s.get(key, _NOT_SET)) for s in every}) > 1]
    shown = "; ".join(_describe(key, every) for key in differing[:_SHOWN])
    more = f"; and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else ""
    raise ConfigError(f"{owner}: the ranks were built with different settings ({shown}{more}); {fix}")


def _flattened(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"param_groups": [{"lr": 0.1}]}`` as ``{"param_groups[0].lr": 0.1}``: a message can
    then name the one setting that differs."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{name}."))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
            for i, entry in enumerate(value):
                flat.update(_flattened(entry, f"{name}[{i}]."))
        else:
            flat[name] = value
    return flat


def _describe(key: str, every: list[dict[str, Any]]) -> str:
    """'key: 0.1 on rank(s) [0], 0.2 on rank(s) [1, 2]', values in the order ranks first hold them."""
    holders: dict[str, list[int]] = {}
    for rank, settings in enumerate(every):
        holders.setdefault(json.dumps(settings.get(key, _NOT_SET)), []).append(rank)
    values = ", ".join(f"{_shown(json.loads(value))} on rank(s) {ranks}" for value, ranks in holders.items())
    return f"{key}: {values}"


def _shown(value: Any) -> str:
    return value if value == _NOT_SET else repr(value)
