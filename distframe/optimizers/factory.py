"""The optimizers ``distframe train --optimizer NAME`` builds by name."""
from __future__ import annotations

from typing import Any

from distframe.errors import ConfigError
from distframe.optimizers.base import ShardedOptimizerBase
from distframe.optimizers.compressed import GradientCompressionOptimizer

_COMPRESSOR_SETTINGS = ("ratio", "rank", "start_iter", "chunk_size", "stochastic", "seed")


def make_optimizer(name: str, model: Any, optimizer: Any, **settings: Any) -> ShardedOptimizerBase:
    """The optimizer that ``distframe train --optimizer NAME`` builds, for the CLI.

    ``compressed``: GradientCompressionOptimizer on a DDPModel; ``compressor`` is a Compressor or
    a name (none, fp16, bf16, int8, topk, powersgd) with its settings as keywords (ratio, rank,
    start_iter, chunk_size, stochastic, seed); ``error_feedback``.
    ``async``: AsyncSGDOptimizer on a DDPModel (max_staleness, server_rank, staleness_lr,
    deterministic, on_worker_failure, worker_timeout, lr_scheduler: the server's).
    ``elastic``: ElasticOptimizer on any data-parallel model (commit_every, checkpoint_dir,
    checkpoint_every, member, lr_scheduler, allow_rollback).
    Remaining keywords go to the torch.optim optimizer (lr, weight_decay, ...).
    """
    if name == "compressed":
        from distframe.optimizers.compression import make_compressor
        compressor = settings.pop("compressor", "none")
        extra = {k: settings.pop(k) for k in _COMPRESSOR_SETTINGS if k in settings}
        if isinstance(compressor, str):
            compressor = make_compressor(compressor, **extra)
        elif extra:
            raise ConfigError(f"compressor settings {sorted(extra)} apply only to a compressor given by name")
        return GradientCompressionOptimizer(model, optimizer, compressor=compressor, **settings)
    if name == "async":
        from distframe.optimizers.async_sgd import AsyncSGDOptimizer
        return AsyncSGDOptimizer(model, optimizer, **settings)
    if name == "elastic":
        from distframe.optimizers.elastic import ElasticOptimizer
        return ElasticOptimizer(model, optimizer, **settings)
    raise ConfigError(f"--optimizer {name!r}: choose compressed, async or elastic")
