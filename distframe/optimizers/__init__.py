"""Optimizers: ShardedOptimizerBase and one optimizer per data-parallel strategy.

Loss scaling over shards: ShardedGradScaler. Beyond data parallelism: GradientCompressionOptimizer
(compressors in ``distframe.optimizers.compression``), AsyncSGDOptimizer (parameter server) and
ElasticOptimizer.
"""
from distframe.optimizers.async_server import AsyncReport
from distframe.optimizers.async_sgd import AsyncConfig, AsyncSGDOptimizer
from distframe.optimizers.base import ShardedOptimizerBase, build_optimizer
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.data_parallel import (
    DDPOptimizer,
    FSDPOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from distframe.optimizers.elastic import Commit, ElasticMember, ElasticOptimizer
from distframe.optimizers.elastic_membership import ElasticController
from distframe.optimizers.elastic_rollback import ElasticRollbackError
from distframe.optimizers.factory import make_optimizer
from distframe.optimizers.grad_scaler import ShardedGradScaler
from distframe.optimizers.protocol import IShardedOptimizer

__all__ = [
    "AsyncConfig",
    "AsyncReport",
    "AsyncSGDOptimizer",
    "Commit",
    "DDPOptimizer",
    "ElasticController",
    "ElasticMember",
    "ElasticOptimizer",
    "ElasticRollbackError",
    "FSDPOptimizer",
    "GradientCompressionOptimizer",
    "IShardedOptimizer",
    "ShardedGradScaler",
    "ShardedOptimizerBase",
    "ZeRO1Optimizer",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
    "build_optimizer",
    "make_optimizer",
]
