"""Optimizers: ShardedOptimizerBase and one optimizer per data-parallel strategy.

(Gradient compression, asynchronous SGD and elastic optimizers live in their own modules.)
"""
from distframe.optimizers.base import ShardedOptimizerBase, build_optimizer
from distframe.optimizers.data_parallel import (
    DDPOptimizer,
    FSDPOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)

__all__ = [
    "DDPOptimizer",
    "FSDPOptimizer",
    "ShardedOptimizerBase",
    "ZeRO1Optimizer",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
    "build_optimizer",
]
