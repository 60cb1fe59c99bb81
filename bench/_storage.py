"""Peak live tensor storage, counted from real storages (the brief's rule for memory claims).

``PeakStorage`` is a TorchDispatchMode: it sees the output of every op run on the thread that
entered it (forward, backward on CPU, optimizer, the collectives' preallocated outputs), holds a
weak reference to each output's storage, and keeps the running total of storages still alive and
its peak. A tensor subclass without storage of its own (DTensor) is counted through its inner
tensors. With ``include_existing`` it first registers every storage reachable from Python (gc),
so the peak is of everything live, not only of what the measured code created.

A storage resized in place is followed: one freed with ``resize_(0)`` stops counting, one
re-allocated with ``resize_(n)`` counts once at its new size.

What it cannot see: tensors made by ops on other threads (a communication thread that allocates
its own outputs) and memory a library allocates without making a tensor (Gloo's internal buffers,
a kernel's scratch space). Say so beside any figure it gives.
"""
from __future__ import annotations

import gc
import resource

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakStorage(TorchDispatchMode):
    """``peak`` and ``current``: bytes of live storage (see the module docstring)."""

    def __init__(self, include_existing: bool = False) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0
        self.include_existing = include_existing

    def __enter__(self):
        if self.include_existing:
            for obj in gc.get_objects():
                if issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookups
                    self._add(obj)
            self.peak = self.current
        return super().__enter__()

    def count(self, *tensors: torch.Tensor) -> None:
        """Counts these tensors' storages as live from now (tensors made before the mode was
        entered, such as a rank's inputs, which ``include_existing`` cannot single out when
        every rank is a thread of one process)."""
        for tensor in tensors:
            self._add(tensor)
        self.peak = max(self.peak, self.current)

    def _add(self, tensor: torch.Tensor) -> None:
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
            for name in tensor.__tensor_flatten__()[0]:  # a wrapper subclass (DTensor): no storage
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.live and storage.nbytes() > 0:
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()

    def _sweep(self) -> None:
        # A storage freed in place (resize_(0): FSDP2's free_storage, distframe's sharded units)
        # stays alive, and one re-allocated with resize_(n) moves to a new address, where _add
        # counts it again. Drop an entry whose storage died or whose pointer or size is no longer
        # what was counted (corrected in the nineteenth session, BENCHMARKS.md).
        for key in list(self.live):
            ref, nbytes = self.live[key]
            if not ref.expired():
                storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                if storage.data_ptr() == key and storage.nbytes() == nbytes:
                    continue
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


def reachable_bytes() -> int:
    """Bytes of the unique storages of every tensor reachable from Python now (gc), a DTensor
    through its inner tensors: a count from real storage to set beside a model's own bookkeeping.
    In a process whose threads are separate ranks it counts every rank's tensors."""
    gc.collect()
    counter = PeakStorage()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            counter._add(obj)
    return counter.current


def live_peak(step) -> int:
    """Peak bytes of live tensor storage over ``step()``, everything reachable when it starts
    counted too (run it after any timed steps: counting slows every op)."""
    gc.collect()
    with PeakStorage(include_existing=True) as mode:
        step()
    return mode.peak


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> float:
    """Resets the process's peak RSS (Linux clear_refs) and returns the current RSS in MiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """The process's peak RSS (MiB) since the last ``reset_peak_rss``."""
    try:
        return _status_kib("VmHWM") / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
