"""Communication backends: one protocol, four engines (threads, MPI, Gloo, NCCL)."""
from distframe.backends.base import DEFAULT_TIMEOUT, CommunicationBackendBase
from distframe.backends.inmemory import InMemoryCommunicationBackend
from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import CommStats, ReduceOp, Work

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommStats",
    "CommunicationBackendBase",
    "ICommunicationBackend",
    "InMemoryCommunicationBackend",
    "ReduceOp",
    "Work",
    "MPICommunicationBackend",
    "GlooCommunicationBackend",
    "NCCLCommunicationBackend",
]


def __getattr__(name: str):
    # The process engines import optional libraries (mpi4py, torch.distributed); load on first use.
    if name == "MPICommunicationBackend":
        from distframe.backends.mpi import MPICommunicationBackend
        return MPICommunicationBackend
    if name == "GlooCommunicationBackend":
        from distframe.backends.torch_dist import GlooCommunicationBackend
        return GlooCommunicationBackend
    if name == "NCCLCommunicationBackend":
        from distframe.backends.torch_dist import NCCLCommunicationBackend
        return NCCLCommunicationBackend
    raise AttributeError(f"module 'distframe.backends' has no attribute {name!r}")
