"""Commit: the snapshot of training state that ElasticOptimizer keeps on every rank, how it travels
between ranks (safetensors bytes, no pickle) and how the ranks' pieces merge into one; and
ElasticMember, the worker that holds its newest commit from one group to the next."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch

from distframe.optimizers.elastic_grad_scaler import agreed_state

_META_KEY = "__elastic_meta__"


@dataclasses.dataclass(frozen=True)
class Commit:
    """A complete snapshot at ``step``: model and optimizer pieces of every rank, merged, and the
    state of what the optimizer owns or was given: its lr scheduler and its GradScaler."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # {"tensors", "scalars", "param_groups"}
    world_size: int
    lr_scheduler: dict[str, Any] | None = None  # the scheduler's state_dict (JSON), if any
    grad_scaler: dict[str, Any] | None = None  # the registered GradScaler's state_dict (JSON), if any
    unregistered_scaler: bool = False  # a GradScaler drove steps but was not passed as grad_scaler=

    def to_bytes(self) -> bytes:
        meta = {"step": self.step, "world_size": self.world_size, "model_keys": sorted(self.model),
                "scalars": self.optimizer["scalars"], "param_groups": self.optimizer["param_groups"],
                "lr_scheduler": self.lr_scheduler, "grad_scaler": self.grad_scaler,
                "unregistered_scaler": self.unregistered_scaler}
        tensors = {**{f"m/{k}": v for k, v in self.model.items()},
                   **{f"o/{k}": v for k, v in self.optimizer["tensors"].items()},
                   _META_KEY: _encode_json(meta)}
        return safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})

    @classmethod
    def from_bytes(cls, blob: bytes) -> Commit:
        tensors = safetensors.torch.load(blob)
        meta = json.loads(bytes(tensors.pop(_META_KEY).tolist()))
        model = {k[2:]: v for k, v in tensors.items() if k.startswith("m/")}
        opt = {k[2:]: v for k, v in tensors.items() if k.startswith("o/")}
        return cls(meta["step"], model, {"tensors": opt, "scalars": meta["scalars"],
                                         "param_groups": meta["param_groups"]}, meta["world_size"],
                   meta.get("lr_scheduler"), meta.get("grad_scaler"), meta.get("unregistered_scaler", False))

    @classmethod
    def merge(cls, parts: Sequence[Commit]) -> Commit:
        """One Commit from every rank's piece (rank order, as all_gather hands them); the pieces
        must agree on the GradScaler's state (ConfigError on every rank alike)."""
        model: dict[str, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for part in parts:
            model.update(part.model)
            tensors.update(part.optimizer["tensors"])
            scalars.update(part.optimizer["scalars"])
        first = parts[0]
        optimizer = {"tensors": tensors, "scalars": scalars, "param_groups": first.optimizer["param_groups"]}
        return cls(first.step, model, optimizer, first.world_size, first.lr_scheduler,
                   agreed_state([p.grad_scaler for p in parts], first.step),
                   any(p.unregistered_scaler for p in parts))


@dataclasses.dataclass
class ElasticMember:
    """One worker's identity across membership changes (owned by whoever runs the workers):
    the newest commit it holds, the step at which its current group ends cleanly, the step of
    the run's newest commit (which restoring must reach; None: unknown), and the step of a
    state loaded by hand that is not committed yet (``ElasticOptimizer.load_state_dict``)."""

    worker_id: int
    commit: Commit | None = None
    until_step: int | None = None
    newest_committed_step: int | None = None
    loaded_step: int | None = None


def _encode_json(obj: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
