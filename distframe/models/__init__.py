"""Models: ShardedModelBase, the data-parallel strategies (DDP, ZeRO-1/2/3, FSDP) and the
model-parallel ones (pipeline, tensor, hybrid 3D)."""
from distframe.models.base import ShardedModelBase
from distframe.models.config import ShardingConfig, TrainingState
from distframe.models.ddp import DDPModel, allreduce_hook
from distframe.models.fsdp import FSDPModel
from distframe.models.gradient_buckets import GradBucket, GradientBuckets
from distframe.models.hybrid import HybridShardedModel
from distframe.models.hybrid_factory import MODEL_PARALLEL_STRATEGIES, build_model_parallel
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.protocol import IShardedModel
from distframe.models.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayerNorm,
    VocabParallelEmbedding,
)
from distframe.models.tensor_parallel_loss import vocab_parallel_cross_entropy
from distframe.models.tensor_parallel_model import TensorParallelModel
from distframe.models.tensor_parallel_plan import apply_tensor_parallel, default_tp_plan
from distframe.models.zero import ZeRO1Model, ZeRO2Model
from distframe.models.zero3 import ZeRO3Model
from distframe.precision import MixedPrecisionPolicy

__all__ = [
    "MODEL_PARALLEL_STRATEGIES",
    "ColumnParallelLinear",
    "DDPModel",
    "FSDPModel",
    "GradBucket",
    "GradientBuckets",
    "IShardedModel",
    "HybridShardedModel",
    "MixedPrecisionPolicy",
    "PipelineParallelModel",
    "RowParallelLinear",
    "ShardedModelBase",
    "ShardedLayerNorm",
    "ShardingConfig",
    "TensorParallelModel",
    "TrainingState",
    "VocabParallelEmbedding",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
    "allreduce_hook",
    "apply_tensor_parallel",
    "build_model_parallel",
    "default_tp_plan",
    "vocab_parallel_cross_entropy",
]
