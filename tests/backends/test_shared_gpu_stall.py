"""In-memory ranks that share a GPU and wait for each other inside backward stop early, with an
error that says why (``[Note: ranks sharing a GPU, waiting inside backward]`` in
``distframe/backends/rendezvous.py``).

The real case needs a CUDA device (tests/models/test_gpu.py, tests/attention/test_gpu.py). Here
the two facts the engine reads are faked on the CPU: which CUDA device's autograd thread a rank
waits on (``autograd_device``), and which GPUs the other ranks have communicated on (``World.gpus``).
Rank 1 never calls, so without the early stop rank 0 would wait for the whole timeout (30 s).
"""
import threading
import time

import pytest
import torch

from distframe import spawn
from distframe.backends import rendezvous
from distframe.errors import CollectiveTimeoutError

TIMEOUT = 30.0


@pytest.fixture
def rank0_on_gpu0_autograd_thread(monkeypatch):
    """Rank 0's calls look as if made on cuda:0's autograd thread; every rank has used cuda:0."""
    rank0_threads = set()
    monkeypatch.setattr(rendezvous, "autograd_device",
                        lambda: 0 if threading.get_ident() in rank0_threads else None)
    return rank0_threads


def _run(waits, rank0_threads, gpus_of_rank1=(0,), timeout=TIMEOUT):
    """Rank 0 runs ``waits(backend)``; rank 1 only waits until rank 0 is done. Returns rank 0's
    exception and the seconds it took."""
    finished = threading.Event()

    def fn(b):
        b.world.gpus.update({0: {0}, 1: set(gpus_of_rank1)})
        if b.rank == 1:
            finished.wait(timeout + 10)
            return None
        rank0_threads.add(threading.get_ident())
        start = time.monotonic()
        try:
            waits(b)
        except CollectiveTimeoutError as error:
            seconds = time.monotonic() - start
            b.world.abort(b.rank, error)  # as spawn does for a failed rank: frees the comm thread
            return error, seconds
        finally:
            finished.set()
        return None, time.monotonic() - start
    return spawn(fn, 2, timeout=timeout)[0]


@pytest.mark.parametrize("call", ["all_reduce", "async all_gather", "recv"])
def test_a_wait_for_a_rank_on_the_same_gpu_stops_at_once(rank0_on_gpu0_autograd_thread, call):
    def waits(b):
        t = torch.ones(4)
        if call == "all_reduce":
            b.all_reduce(t)
        elif call == "async all_gather":
            b.all_gather(t, async_op=True).wait()
        else:
            b.irecv(t, src=1).wait()
    error, seconds = _run(waits, rank0_on_gpu0_autograd_thread)
    assert error is not None and seconds < 5, (error, seconds)
    assert error.missing_ranks == [1]
    assert "inside backward on torch's autograd thread for cuda:0" in str(error)
    assert "need a GPU each" in str(error)


def test_a_rank_on_another_gpu_is_waited_for(rank0_on_gpu0_autograd_thread):
    """Rank 1 on cuda:1 has its own autograd thread, so it may still arrive: rank 0 waits for
    the ordinary timeout (3 s here, past the 1 s after which the engine checks)."""
    error, seconds = _run(lambda b: b.barrier(), rank0_on_gpu0_autograd_thread,
                          gpus_of_rank1=(1,), timeout=3.0)
    assert error is not None and error.missing_ranks == [1]
    assert "autograd thread" not in str(error) and seconds >= 2.9


def test_off_the_autograd_thread_nothing_stops_early(rank0_on_gpu0_autograd_thread):
    error, seconds = _run(lambda b: b.barrier(), set(), timeout=3.0)
    assert error is not None and "autograd thread" not in str(error) and seconds >= 2.9
