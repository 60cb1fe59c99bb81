"""distframe: distributed training strategies over one communication protocol."""
from distframe import compile_support as _compile_support

_compile_support.install()  # torch.compile skips distframe's own frames: [Note: torch.compile]

from distframe.backends import (
    CommStats,
    CommunicationBackendBase,
    ICommunicationBackend,
    InMemoryCommunicationBackend,
    ReduceOp,
    Work,
)
from distframe.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    DistFrameError,
    RankFailedError,
)
from distframe.launch import init_backend, spawn
from distframe.mesh import ParallelDims
from distframe.models import (
    DDPModel,
    FSDPModel,
    HybridShardedModel,
    IShardedModel,
    PipelineParallelModel,
    ShardedModelBase,
    ShardingConfig,
    TensorParallelModel,
    ZeRO1Model,
    ZeRO2Model,
    ZeRO3Model,
)
from distframe.optimizers import (
    AsyncSGDOptimizer,
    DDPOptimizer,
    ElasticOptimizer,
    FSDPOptimizer,
    GradientCompressionOptimizer,
    IShardedOptimizer,
    ShardedGradScaler,
    ShardedOptimizerBase,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from distframe.precision import MixedPrecisionPolicy

__version__ = "0.1.0"

__all__ = [
    "AsyncSGDOptimizer",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommStats",
    "CommunicationBackendBase",
    "ConfigError",
    "DDPModel",
    "DDPOptimizer",
    "DistFrameError",
    "ElasticOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "GradientCompressionOptimizer",
    "HybridShardedModel",
    "ICommunicationBackend",
    "IShardedModel",
    "IShardedOptimizer",
    "InMemoryCommunicationBackend",
    "MixedPrecisionPolicy",
    "ParallelDims",
    "PipelineParallelModel",
    "RankFailedError",
    "ReduceOp",
    "ShardedGradScaler",
    "ShardedModelBase",
    "ShardedOptimizerBase",
    "ShardingConfig",
    "TensorParallelModel",
    "Work",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
    "init_backend",
    "spawn",
]
