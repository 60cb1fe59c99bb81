"""Shared pieces of the model tests: tiny models (an MLP of residual blocks, the tiny LM), global
batches, the single-process reference, and the strategy table."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from attention.model import DilatedTransformerConfig, DilatedTransformerLM

from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from distframe.optimizers import (DDPOptimizer, FSDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer,
                                  ZeRO3Optimizer)

STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero3": (ZeRO3Model, ZeRO3Optimizer),
    "fsdp": (FSDPModel, FSDPOptimizer),
}
# Small buckets / units so every mechanism is exercised with several buckets and units.
SETTINGS = {
    "ddp": {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005},
    "zero1": {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005},
    "zero2": {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005},
    "zero3": {},
    "fsdp": {"auto_wrap_min_params": 100},
}
IN, HIDDEN, OUT = 6, 17, 3   # odd sizes: flat spaces need padding for most world sizes


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


# In-memory ranks are threads sharing torch's global generator: seed and build under this lock.
SEED_LOCK = threading.Lock()


def tiny_lm(num_layers: int = 2, tie: bool = True, seed: int = 0,
            dropout: float = 0.0) -> DilatedTransformerLM:
    """The float64 tiny LM (seq 16, width 16, 4 heads, segments 4/8/16 at rates 1/2/4); ``dropout``
    on the residual stream, in the MLP and on the attention probabilities."""
    config = DilatedTransformerConfig.preset(
        "tiny", seq_len=16, embed_dim=16, num_heads=4, num_layers=num_layers,
        segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4), tie_embeddings=tie, dropout=dropout)
    with SEED_LOCK:
        torch.manual_seed(seed)
        return DilatedTransformerLM(config).double()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(dtype=torch.float64, seed: int = 0) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), Block(HIDDEN), Block(HIDDEN),
                             nn.Linear(HIDDEN, OUT)).to(dtype)


def global_batches(steps: int, batch: int, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, IN, generator=g, dtype=dtype),
             torch.randn(batch, OUT, generator=g, dtype=dtype)) for _ in range(steps)]


def rank_slice(batch, rank: int, world: int):
    x, y = batch
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def reference_run(batches, dtype=torch.float64, lr=1e-2, device="cpu"):
    """Single-process Adam on whole batches (model and batches on ``device``): parameters after
    every step."""
    model = build_model(dtype).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    for x, y in batches:
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history
