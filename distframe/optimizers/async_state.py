"""The parameter server's optimizer state as bytes, so AsyncSGDOptimizer can replicate it from the
server onto the workers (whose own optimizers never step) before a checkpoint; and its param
groups' settings alone (``replicate_settings``), which ``synchronize_parameters`` replicates: a
checkpoint takes rank 0's, and the run's are the server's (a rate set there by hand).

The state is the range-keyed pieces of ``sharded_state`` for every segment (the server holds it
all), their per-parameter scalars, the hyperparameters and the server's lr scheduler state, in
one safetensors blob with a JSON header: no pickle crosses between ranks.
"""
from __future__ import annotations

import json
from typing import Any

import safetensors.torch
import torch

from distframe.backends.objects import broadcast_bytes
from distframe.backends.protocol import ICommunicationBackend
from distframe.models.sharded_state import RangeReader, ShardLayout
from distframe.optimizers.sharded_state import hyperparameters, load_optimizer_pieces, optimizer_pieces

_META_KEY = "__async_server_state__"


def encode_state(layout: ShardLayout, optimizer: torch.optim.Optimizer,
                 lr_scheduler: dict[str, Any] | None = None) -> bytes:
    """Every segment's optimizer state (as if one rank wrote the whole replicated layout), and
    ``lr_scheduler``, the scheduler's state (JSON) or None."""
    tensors, scalars = optimizer_pieces(layout, optimizer, 0, 1)
    meta = {"scalars": scalars, "param_groups": hyperparameters(optimizer), "lr_scheduler": lr_scheduler}
    header = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return safetensors.torch.save({**{k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                                   _META_KEY: header})


def decode_state(layout: ShardLayout, optimizer: torch.optim.Optimizer, blob: bytes) -> dict[str, Any] | None:
    """Replaces ``optimizer``'s state and hyperparameters with those ``encode_state`` wrote;
    returns the scheduler state it was given."""
    tensors = safetensors.torch.load(blob)
    meta = json.loads(bytes(tensors.pop(_META_KEY).tolist()))
    load_optimizer_pieces(layout, optimizer, RangeReader.from_tensors(tensors), meta["scalars"],
                          meta["param_groups"])
    return meta.get("lr_scheduler")


def replicate_settings(backend: ICommunicationBackend, optimizer: torch.optim.Optimizer, server: int) -> bool:
    """Gives every rank's param groups the settings (lr, momentum, betas, ...) of the server's
    (two small broadcasts); returns whether this rank is the server, whose stay as they are.
    The groups are the same on every rank (construction checks it). A tensor setting is
    written in place, as a capturable optimizer and an lr scheduler hold on to it; a tuple
    (betas) stays a tuple."""
    is_server = backend.rank == server
    blob = json.dumps(hyperparameters(optimizer)).encode() if is_server else b""
    blob = broadcast_bytes(backend, blob, server)
    if is_server:
        return True
    for group, settings in zip(optimizer.param_groups, json.loads(blob), strict=True):
        for key, value in settings.items():
            group[key] = _merged(group.get(key), value)
    return False


def _merged(current: Any, value: Any) -> Any:
    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.fill_(value)
        return current
    if isinstance(current, (tuple, list)) and isinstance(value, list) and len(current) == len(value):
        return type(current)(_merged(c, v) for c, v in zip(current, value))
    return value
