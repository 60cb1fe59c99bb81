"""The parameter server's optimizer state as bytes, so AsyncSGDOptimizer can replicate it from the
server onto the workers (whose own optimizers never step) before a checkpoint.

The state is the range-keyed pieces of ``sharded_state`` for every segment (the server holds it
all), their per-parameter scalars, the hyperparameters and the server's lr scheduler state, in
one safetensors blob with a JSON header: no pickle crosses between ranks.
"""
from __future__ import annotations

import json
from typing import Any

import safetensors.torch
import torch

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
