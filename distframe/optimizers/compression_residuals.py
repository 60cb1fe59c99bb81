"""Error-feedback residuals of GradientCompressionOptimizer (``compressed.py``): their dtype,
how one joins the next gradient, and how saved ones are dealt to the ranks of a resumed run.

[Note: residual dtype] A residual is kept in float32 for fp16 and bf16 parameters (twice the
parameter's bytes; for float32 and float64 ones, in their dtype, as their gradients). In fp16 a
residual under loss scaling sits near the top of the range, and the scale's growth
(``loss_scale_changed``) took it past 65504 to inf; inf times the backoff factor stays inf, so
every later gradient overflowed and every later step was skipped. In float32 the grown residual
stays finite: added to the next fp16 gradient it overflows that one step, which is skipped, and
the backoff brings the residual back into range. float32 also keeps what fp16 or bf16 rounding
lost: the gradient plus the residual is formed in float32, and what rounding it to the
gradient's dtype for the compressor drops (``add_residual``) joins the next residual, so it is
delayed, not dropped.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from distframe.errors import ConfigError
from distframe.models.sharded_state import RangeReader

RESIDUAL_KIND = "compression.residual.rank{rank}"  # a saved residual's piece kind, per rank
SCALE_KIND = "compression.loss_scale"  # the loss scale the saved residuals are in


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision gradients, else their own dtype (see [Note: residual dtype])."""
    return torch.promote_types(dtype, torch.float32)


def add_residual(view: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    """Adds ``residual`` to the gradient ``view`` in place; returns what rounding the sum to the
    gradient's dtype lost (in the residual's dtype), or None where the dtypes are the same (the
    sum is then formed in the gradient's dtype, as it always was). Past the gradient's range the
    view holds inf: the step is skipped, and the returned part with it."""
    if residual.dtype == view.dtype:
        view.add_(residual)
        return None
    given = view.to(residual.dtype) + residual
    view.copy_(given)
    return given - view.to(residual.dtype)


def load_residuals(reader: RangeReader, kinds: set[str], params: Mapping[str, torch.Tensor],
                   rank: int, world_size: int, saved_world: int | None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s residuals, in ``residual_dtype`` of their parameter; saved under another
    world size, re-dealt so that their mean over ranks, the part of the averaged gradient still
    to be sent, stays what it was. ``saved_world``: the saving run's world size (None: one more
    than the highest rank whose residuals ``reader`` holds). ConfigError where ``reader`` lacks a
    saved rank's residuals that this rank takes (one rank's state, loaded at another world size).

    [Note: residuals across world sizes] The averaged gradient carries (1/W) * sum of the
    W residuals. Loaded at W' ranks, rank j takes the sum of saved ranks r = j (mod W')
    times W'/W: the W' new residuals then carry the same mean. (Before, ranks beyond W'
    were dropped, and growing the world diluted the old ones by W/W'.)"""
    prefix = RESIDUAL_KIND.format(rank="")
    saved = sorted(int(k.removeprefix(prefix)) for k in kinds
                   if k.startswith(prefix) and k.removeprefix(prefix).isdigit())
    if saved_world is None:
        saved_world = saved[-1] + 1 if saved else world_size
    # Every rank of a run keeps residuals of the same parameters: none saved, or all ranks'.
    lacking = [r for r in range(rank, saved_world, world_size) if r not in saved]
    if saved and lacking:
        raise ConfigError(
            f"the optimizer state loaded holds the error-feedback residuals of rank(s) {saved} of the "
            f"saving run's {saved_world}, and rank {rank} of {world_size} takes those of rank(s) "
            f"{lacking} too: load a distframe checkpoint, or every rank's state_dict()['tensors'] "
            "merged; a rank's own state_dict() loads back only at its own rank and world size")
    sources = [RESIDUAL_KIND.format(rank=r) for r in saved if r % world_size == rank]
    residuals = {}
    for name, param in params.items():
        parts = [reader.read(kind, name, 0, param.numel())
                 for kind in sources if reader.holds(kind, name)]
        if not parts:
            continue
        # (a checkpoint written before residuals of half parameters were float32 holds fp16)
        total = parts[0].to(residual_dtype(param.dtype), copy=True)
        for part in parts[1:]:
            total += part
        if saved_world != world_size:
            total *= world_size / saved_world
        residuals[name] = total.view(param.shape)
    return residuals


class ResidualScale:
    """The loss scale the residuals are in ([Note: residuals under loss scaling] in
    ``compressed.py``: that of the last step's backward, moved by ``loss_scale_changed``), saved
    with them. A checkpoint does not hold the scaler: a resumed step at another scale (a fresh
    scaler, or none) would add the residuals to its gradients off by new scale / saved scale,
    so the first step after a load checks the scale it runs at against the saved one."""

    def __init__(self) -> None:
        self.scale: torch.Tensor | float = 1.0
        self.loaded: float | None = None

    def stepping(self, grad_scale: torch.Tensor | None, owner: str) -> None:
        """A step (taken or skipped) at ``grad_scale`` (None: no loss scaling); ConfigError,
        before anything moves, when it is the first after a load and the scale differs."""
        now = 1.0 if grad_scale is None else grad_scale
        if self.loaded is not None and float(now) != self.loaded:
            runs = ("without loss scaling (scale 1)" if grad_scale is None
                    else f"at the scaler's loss scale {float(now):g}")
            raise ConfigError(
                f"{owner}: the error-feedback residuals were saved at loss scale {self.loaded:g}, but "
                f"this step runs {runs}, so they would join the gradients off by that factor; "
                "restore the scaler saved beside the checkpoint (a ShardedGradScaler and "
                f"scaler.load_state_dict(saved_state)), or build one with init_scale={self.loaded:g}")
        self.loaded = None
        self.scale = now if isinstance(now, float) else now.detach().clone()

    def changed(self, factor: torch.Tensor) -> None:
        if isinstance(self.scale, float):
            self.scale = self.scale * factor.double()
        else:
            self.scale = self.scale * factor.to(self.scale.device, self.scale.dtype)

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{SCALE_KIND}/scale@0"] = torch.tensor([float(self.scale)], dtype=torch.float64)

    def load(self, saved: float | None) -> None:
        """The saved scale (None: none saved), which the first step checks."""
        self.loaded = saved


def saved_loss_scale(reader: RangeReader, kinds: set[str]) -> float | None:
    """The loss scale ``ResidualScale.save`` stored, or None."""
    return float(reader.read(SCALE_KIND, "scale", 0, 1)[0]) if SCALE_KIND in kinds else None
