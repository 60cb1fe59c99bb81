"""Models: ShardedModelBase and the data-parallel strategies (DDP, ZeRO-1/2/3, FSDP)."""
from distframe.models.base import ShardedModelBase
from distframe.models.config import ShardingConfig, TrainingState
from distframe.models.ddp import DDPModel, allreduce_hook
from distframe.models.fsdp import FSDPModel
from distframe.models.gradient_buckets import GradBucket, GradientBuckets
from distframe.models.zero import ZeRO1Model, ZeRO2Model
from distframe.models.zero3 import ZeRO3Model
from distframe.precision import MixedPrecisionPolicy

__all__ = [
    "DDPModel",
    "FSDPModel",
    "GradBucket",
    "GradientBuckets",
    "MixedPrecisionPolicy",
    "ShardedModelBase",
    "ShardingConfig",
    "TrainingState",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
    "allreduce_hook",
]
