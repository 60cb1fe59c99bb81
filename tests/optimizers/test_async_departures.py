"""AsyncSGDOptimizer when a worker stops without finish(): one that goes silent is dropped at
the worker_timeout; one whose function returns has left the group (distframe.backends.departures),
which the server sees at once and reports as such, over the in-memory engine and Gloo."""
import copy
import time

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.optimizers.test_async_sgd import LR, MLP, _batch

def _run(world, worker_fn, **settings):
    """The server's report; workers run ``worker_fn(backend, optimizer)``."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, **settings)
        return opt.serve() if opt.is_server else worker_fn(b, opt)
    return spawn(fn, world, timeout=60)[0]


def _leaving_worker(steps, how):
    """Rank 3 stops after 2 steps holding parameters it pulled: "silent" sleeps past the
    worker_timeout before it returns, "returns" returns at once, without finish()."""
    def worker(b, opt):
        for k in range(steps if b.rank != 3 else 2):
            opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
        if b.rank == 3 and how == "silent":
            time.sleep(2.0)
        if b.rank != 3:
            opt.finish()
        return None, opt.stopped
    return worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [False, True])
def test_silent_worker_is_declared_dead_after_the_timeout(deterministic):
    steps = 6
    report = _run(4, _leaving_worker(steps, "silent"), max_staleness=2, worker_timeout=0.5,
                  deterministic=deterministic)
    assert report.failed_workers == {3: "sent nothing for 0.5 s"}
    assert report.updates_per_worker == {1: steps, 2: steps, 3: 2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_worker_that_returns_without_finish_is_dropped_at_once_and_named_so(deterministic):
    """The engine knows the worker's function returned: the server must say so, and must not
    wait for the 30 s worker_timeout first."""
    steps = 6
    start = time.monotonic()
    report = _run(4, _leaving_worker(steps, "returns"), max_staleness=2, worker_timeout=30,
                  deterministic=deterministic)
    assert time.monotonic() - start < 15
    assert list(report.failed_workers) == [3]
    assert "returned without calling finish()" in report.failed_workers[3]
    assert report.updates_per_worker == {1: steps, 2: steps, 3: 2}


def _returning_rank(b):
    """Rank 2 returns after one step without finish(); the others train 4 steps."""
    model = DDPModel(copy.deepcopy(MLP), b)
    opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, max_staleness=2, worker_timeout=60)
    if opt.is_server:
        return opt.serve()
    for k in range(1 if b.rank == 2 else 4):
        opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
    if b.rank != 2:
        opt.finish()
    return None


@pytest.mark.gloo
@pytest.mark.timeout(120)
def test_gloo_server_drops_a_worker_that_returned_without_finish_at_once():
    """Over Gloo the server learns of the departure from the store, not from a failed receive:
    it must drop the worker well before its 60 s worker_timeout, saying that it returned."""
    start = time.monotonic()
    report = spawn(_returning_rank, 4, "gloo", timeout=90)[0]
    assert time.monotonic() - start < 40
    assert list(report.failed_workers) == [2]
    assert "returned without calling finish()" in report.failed_workers[2]
    assert report.updates_per_worker == {1: 4, 2: 1, 3: 4}
