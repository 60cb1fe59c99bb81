"""DDPModel trains a call of the module it wraps (``model.module(x)``, the user's own ``net(x)``) as a
call of the wrapper: the gradients of its backward are averaged across ranks. They were not: only
the wrapper's own forward armed the reduction, so each rank stepped its own slice's gradient and the
replicas drifted apart without an error (0.054 off one process after one SGD step, ranks 0.109
apart); a direct call after a step of the wrapper raised "a gradient arrived ... after it was
reduced". Every rank gets its own slice here (the same batch on every rank hides the bug).
float64, 1e-10 against one process on the whole batch."""
from __future__ import annotations

import functools

import pytest
import torch

from distframe.launch import spawn
from distframe.models import DDPModel
from distframe.optimizers import DDPOptimizer, GradientCompressionOptimizer
from distframe.optimizers.compression import IdentityCompressor
from tests.models.common import (SETTINGS, build_model, global_batches, loss_fn, rank_slice,
                                 reference_run)

TOL = dict(rtol=0, atol=1e-10)
DATA = global_batches(3, 12)


def _optimizer(model, kind):
    if kind == "ddp":
        return DDPOptimizer(model, torch.optim.Adam, lr=1e-2)
    if kind == "plain":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    return GradientCompressionOptimizer(model, torch.optim.Adam, compressor=IdentityCompressor(), lr=1e-2)


def _train(backend, call, kind, sharing=False):
    net = build_model()
    model = DDPModel(net, backend, **SETTINGS["ddp"])
    if sharing:  # as in-memory ranks sharing a GPU: the average completes at the step (deferred_finish)
        peers = [r for r in range(backend.world_size) if r != backend.rank]
        backend.peers_sharing_autograd_thread = lambda: peers
    opt = _optimizer(model, kind)
    callers = {"module": lambda x: model.module(x), "net": net, "wrapper": model}
    averaged = []
    for step, batch in enumerate(DATA):
        x, y = rank_slice(batch, backend.rank, backend.world_size)
        # "mixed": the wrapper in the first step, the module itself afterwards
        caller = callers[call if call != "mixed" else "wrapper" if step == 0 else "module"]
        loss_fn(caller(x), y).backward()
        if not sharing:  # averaged when backward returns, as the wrapper's call is
            averaged.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters(), averaged


@pytest.mark.parametrize("call", ["module", "net", "mixed"])
@pytest.mark.parametrize("kind", ["ddp", "plain", "compressed"])
def test_a_direct_call_trains_as_one_process(call, kind):
    expected = reference_run(DATA)[-1]
    results = spawn(functools.partial(_train, call=call, kind=kind), 2, timeout=60)
    for params, _ in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)
    for grads in zip(*(averaged for _, averaged in results)):
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_direct_call_trains_as_one_process_on_gloo():
    expected = reference_run(DATA)[-1]
    train = functools.partial(_train, call="module", kind="ddp")
    for params, _ in spawn(train, 2, backend="gloo", timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.filterwarnings("ignore:in-memory ranks .* share this rank's GPU")
def test_a_direct_call_trains_as_one_process_where_the_average_is_deferred():
    expected = reference_run(DATA)[-1]
    for params, _ in spawn(functools.partial(_train, call="net", kind="plain", sharing=True), 2, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


def test_direct_calls_accumulated_under_no_sync_train_as_one_process():
    # Micro-batches called directly, all but the last under no_sync: one step on the whole batch.
    k, world = 3, 2
    big = global_batches(1, 4 * k * world)[0]

    def run(backend):
        net = build_model()
        model = DDPModel(net, backend, **SETTINGS["ddp"])
        opt = DDPOptimizer(model, torch.optim.Adam, lr=1e-2)
        for j in range(k):
            x, y = rank_slice(big, j * world + backend.rank, k * world)
            with model.no_sync() if j < k - 1 else torch.enable_grad():
                (loss_fn(net(x), y) / k).backward()
        opt.step()
        return model.gather_full_parameters()

    expected = reference_run([big])[0]
    for params in spawn(run, world, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


def test_a_direct_call_without_grad_or_without_backward_communicates_nothing():
    # An evaluation (no_grad), or a forward with grad on one rank alone that no backward follows
    # (a logged sample): no collective, so the ranks stay in step and training is unchanged.
    expected = reference_run(DATA[:1])[-1]

    def run(backend):
        net = build_model()
        model = DDPModel(net, backend, **SETTINGS["ddp"])
        opt = DDPOptimizer(model, torch.optim.Adam, lr=1e-2)
        x, y = rank_slice(DATA[0], backend.rank, backend.world_size)
        backend.stats.reset()
        with torch.no_grad():
            net(x)
        if backend.rank == 0:
            net(x)
        sent = sum(backend.stats.calls.values())
        loss_fn(net(x), y).backward()
        opt.step()
        return sent, model.gather_full_parameters()

    for sent, params in spawn(run, 2, timeout=60):
        assert sent == 0
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)
