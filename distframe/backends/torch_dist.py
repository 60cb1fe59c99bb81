"""GlooCommunicationBackend and NCCLCommunicationBackend: the protocol over torch.distributed,
and ``from_environment`` for processes that torchrun started.

Both engines are thin subclasses of ``torch_dist_engine.TorchDistributedBackend``, which holds
every collective: they differ only in the process group they build and the device their tensors
live on. See that module for the design (one process group per (sub)group, built directly on a
store; a progress board for timeouts; buffered point to point; the cost of ``debug=True``).
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from distframe.backends.base import DEFAULT_TIMEOUT
from distframe.backends.torch_dist_engine import TorchDistributedBackend, _Shared
from distframe.errors import BackendUnavailableError, ConfigError

__all__ = ["GlooCommunicationBackend", "NCCLCommunicationBackend", "TorchDistributedBackend",
           "from_environment", "require_gpus"]


class GlooCommunicationBackend(TorchDistributedBackend):
    """One rank of a group over ``torch.distributed.ProcessGroupGloo`` (CPU tensors; tensors on
    other devices are staged through host memory). Every collective is Gloo's own operation;
    int16 and complex tensors travel as bytes or are reduced in a wider form (``torch_dist_wire``).

    ``hostname``: the address Gloo listens on (None: Gloo's default, from the machine's hostname
    or ``GLOO_SOCKET_IFNAME``). Build a group with ``distframe.launch.spawn(fn, n, "gloo")``,
    ``init_backend("gloo")`` under torchrun, or directly from a store every rank can reach.
    """

    engine = "gloo"
    _posts_first = True  # CPU tensors: see distframe.backends.posted

    def __init__(self, rank: int, world_size: int, store: dist.Store, *,
                 timeout: float = DEFAULT_TIMEOUT, debug: bool = False, prefix: str = "distframe",
                 hostname: str | None = None, _shared: _Shared | None = None) -> None:
        self._hostname = hostname
        self._device = torch.device("cpu")
        super().__init__(rank, world_size, store, timeout=timeout, debug=debug, prefix=prefix,
                         _shared=_shared)

    def _create_process_group(self, store: dist.Store, rank: int, world_size: int,
                              timeout: datetime.timedelta) -> Any:
        if self._hostname is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._hostname)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)

    def _sibling_kwargs(self) -> dict[str, Any]:
        return {"hostname": self._hostname}


class NCCLCommunicationBackend(TorchDistributedBackend):
    """One rank of a group over ``torch.distributed.ProcessGroupNCCL``, one GPU per rank
    (``device``: the CUDA index, default the rank). GPU tensors are used directly; CPU tensors
    are copied to the rank's GPU for the call and the results copied back (one host-device copy
    each way). NCCL matches point-to-point messages in order, ignoring tags. NCCL's watchdog may
    end a process whose collective times out before distframe can report it; see
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in the torch documentation.
    """

    engine = "nccl"
    # NCCL's wait(timeout) marks the work failed once the timeout passes, so waits are not sliced:
    # a departure is named only when the departed rank's connections close.
    _wait_slice = datetime.timedelta(0)

    def __init__(self, rank: int, world_size: int, store: dist.Store, *, device: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT, debug: bool = False, prefix: str = "distframe",
                 _shared: _Shared | None = None) -> None:
        index = rank if device is None else device
        require_gpus(index + 1)
        self._device = torch.device("cuda", index)
        super().__init__(rank, world_size, store, timeout=timeout, debug=debug, prefix=prefix,
                         _shared=_shared)

    def _create_process_group(self, store: dist.Store, rank: int, world_size: int,
                              timeout: datetime.timedelta) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    def _sibling_kwargs(self) -> dict[str, Any]:
        return {"device": self._device.index}

    def _shutdown(self) -> None:
        group = self._pg
        super()._shutdown()
        # An NCCL group left to its destructor aborts there, warning that destroy_process_group()
        # was never called. Every call of this engine has completed or failed by now, so abort it
        # here: unlike the graceful shutdown(), abort does not wait for kernels a failed peer
        # left unfinished, which could hang.
        close = getattr(group, "abort", None) or getattr(group, "shutdown", None)
        if close is not None:
            close()


def visible_gpus() -> int:
    """How many CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(count: int) -> None:
    """Raises BackendUnavailableError unless NCCL and ``count`` CUDA devices are usable here."""
    # The one place backends look at CUDA: NCCL is only meaningful with GPUs.
    visible = visible_gpus()
    if visible < count:
        found = "no CUDA GPU is visible" if visible == 0 else f"only {visible} CUDA GPUs are visible"
        raise BackendUnavailableError(
            f"the nccl backend runs one rank per GPU and needs {count} GPUs, but {found} "
            f"(torch {torch.__version__}); use backend='gloo' on CPUs, or fewer ranks per machine")
    if not dist.is_nccl_available():
        raise BackendUnavailableError(
            f"this torch ({torch.__version__}) was built without NCCL; install a CUDA build of "
            "torch (see https://pytorch.org/get-started) or use backend='gloo'")


def from_environment(name: str, *, timeout: float = DEFAULT_TIMEOUT, **backend_kwargs: Any
                     ) -> TorchDistributedBackend:
    """The world backend of a process started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT locate the store (torchrun's agent store when it provides one); NCCL uses GPU
    LOCAL_RANK. A variable that is not an integer in range is a ConfigError, raised before the
    rendezvous; so is a MASTER_PORT in use, and a store not reached in ``timeout`` seconds is
    BackendUnavailableError (each one line, not torch's DistNetworkError or DistStoreError)."""
    if name not in ("gloo", "nccl"):
        raise ConfigError(f"from_environment builds 'gloo' or 'nccl' backends, not {name!r}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise BackendUnavailableError(f"{', '.join(missing)} not set: start the program with "
                                      f"torchrun, or use spawn(fn, world_size, backend={name!r})")
    # Checked before the rendezvous: a rank out of range waited there for the whole timeout.
    world_size = _variable("WORLD_SIZE", 1, None, "the number of processes")
    rank = _variable("RANK", 0, world_size - 1, "this process's rank")
    local_rank = _variable("LOCAL_RANK", 0, None, "this process's rank on its node", default=rank)
    _variable("MASTER_PORT", 1, 65535, "the port of rank 0's store")
    if name == "nccl":
        require_gpus(local_rank + 1)
    store = _rendezvous(rank, world_size, timeout)
    # A restarted torchrun job meets in the same store: keep its keys apart from the last run's.
    prefix = f"distframe/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    # Each call builds a new group (as MPI's Dup does), in the same store: a second group under
    # the first one's keys read its stale Gloo addresses and failed to connect at the timeout.
    # Every rank counts its own calls, so the n-th call of each rank meets the n-th of the others.
    prefix = f"{prefix}/init{store.add(f'{prefix}/init_calls/{rank}', 1)}"
    if name == "gloo":
        return GlooCommunicationBackend(rank, world_size, store, timeout=timeout, prefix=prefix,
                                        **backend_kwargs)
    backend_kwargs.setdefault("device", local_rank)
    return NCCLCommunicationBackend(rank, world_size, store, timeout=timeout, prefix=prefix,
                                    **backend_kwargs)


def _variable(name: str, minimum: int, maximum: int | None, meaning: str, default: int | None = None) -> int:
    """The launcher variable ``name`` as an int from ``minimum`` to ``maximum`` (None: no upper
    bound), or ``default`` where it is unset and one is given; ConfigError naming it otherwise."""
    value = os.environ.get(name)
    if value is None and default is not None:
        return default
    allowed = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise ConfigError(f"{name}={value}: set {name} to {meaning}, an integer {allowed} (torchrun "
                          "sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT for each process it starts)")
    return number


def _rendezvous(rank: int, world_size: int, timeout: float) -> dist.Store:
    """The store of torch's env:// rendezvous; its failures as one line that says what to change."""
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size,
                                           timeout=datetime.timedelta(seconds=timeout)))
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc):
            raise ConfigError(f"MASTER_PORT {os.environ['MASTER_PORT']} is in use on this machine: pick "
                              "another MASTER_PORT (torchrun --master-port) for rank 0's store") from exc
        raise BackendUnavailableError(
            f"rank {rank} could not reach rank 0's store at {address} ({_first_line(exc)}); check "
            "MASTER_ADDR and MASTER_PORT, and that rank 0 is running, or raise the timeout (--timeout)"
        ) from exc
    except dist.DistStoreError as exc:
        raise BackendUnavailableError(
            f"not every one of WORLD_SIZE={world_size} ranks reached the store at {address} within "
            f"{timeout:g} s ({_first_line(exc)}); start every rank with the same MASTER_ADDR and "
            "MASTER_PORT, or raise the timeout (--timeout)") from exc
    return store


def _first_line(exc: Exception) -> str:
    """torch's message without the C++ context that may follow it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
