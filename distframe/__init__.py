"""distframe: distributed training strategies over one communication protocol."""
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

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommStats",
    "CommunicationBackendBase",
    "ConfigError",
    "DistFrameError",
    "ICommunicationBackend",
    "InMemoryCommunicationBackend",
    "RankFailedError",
    "ReduceOp",
    "Work",
    "init_backend",
    "spawn",
]
