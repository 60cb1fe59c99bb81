"""AsyncSGDOptimizer and a model's buffers (in-memory engine, float64): a push carries the
worker's buffers and the server takes them (floating ones replaced, integer counters such as
num_batches_tracked added to), a pull hands the server's back, so the deterministic mode equals
its sequential replay, buffers included; a model without buffers sends what it did before."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.optimizers.test_async_sgd import LR, MLP, _batch

torch.manual_seed(11)
# Two BatchNorms: one with an exponential average, one with momentum=None (a cumulative average,
# whose factor 1 / num_batches_tracked needs the counter right).
BN_NET = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 4),
                       nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 2)).double()


def _state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _worker_step(state, batch):
    """What a worker computes on the state it pulled: its gradients and its buffers after the
    forward (BatchNorm updates the running statistics in train mode)."""
    net = copy.deepcopy(BN_NET)
    net.load_state_dict(state)
    nn.functional.mse_loss(net(batch[0]), batch[1]).backward()
    return [p.grad for p in net.parameters()], dict(net.named_buffers())


def _server_applies(current, pulled, grads, buffers):
    """One torch.optim.SGD step on the server's parameters; the pushed floating buffers replace
    the server's, the counters grow by what the worker's step added."""
    net = copy.deepcopy(BN_NET)
    net.load_state_dict(current)
    for p, g in zip(net.parameters(), grads):
        p.grad = g.clone()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    state = _state(net)
    for name, value in buffers.items():
        if value.dtype.is_floating_point:
            state[name] = value.detach().clone()
        else:
            state[name] = current[name] + (value - pulled[name])
    return state


def test_deterministic_run_with_batchnorm_equals_the_sequential_replay_buffers_included():
    """Before, the server never got the workers' buffers: its running statistics stayed the
    initial ones, and each worker normalised its running averages on its own."""
    world, steps, workers = 4, 4, [1, 2, 3]

    def fn(b):
        model = DDPModel(copy.deepcopy(BN_NET), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, max_staleness=4, deterministic=True)
        if opt.is_server:
            report = opt.serve()
            return report, _state(model.wrapped_model)
        for k in range(steps):
            opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
        opt.finish()
        return None
    report, server_state = spawn(fn, world, timeout=60)[0]
    current = _state(BN_NET)
    pulled = {w: current for w in workers}
    for k in range(steps):
        for w in workers:
            grads, buffers = _worker_step(pulled[w], _batch(w, k))
            current = _server_applies(current, pulled[w], grads, buffers)
            pulled[w] = current
    assert report.updates == steps * len(workers) and report.max_staleness_seen == len(workers) - 1
    assert server_state.keys() == current.keys()
    for name, value in current.items():
        assert torch.equal(server_state[name], value), name
    assert int(server_state["1.num_batches_tracked"]) == steps * len(workers)
    assert not torch.equal(server_state["1.running_mean"], BN_NET.state_dict()["1.running_mean"])


def _one_step_traffic(net, **model_settings):
    """A worker's (sends, bytes sent, receives, bytes received) for one train_step after the first."""
    def fn(b):
        model = DDPModel(copy.deepcopy(net), b, **model_settings)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, max_staleness=0, deterministic=True)
        if opt.is_server:
            opt.serve()
            return None
        opt.train_step(_batch(b.rank, 0), nn.functional.mse_loss)
        b.stats.reset()
        opt.train_step(_batch(b.rank, 1), nn.functional.mse_loss)
        traffic = (b.stats.calls["send"], b.stats.bytes["send"], b.stats.calls["recv"], b.stats.bytes["recv"])
        opt.finish()
        return traffic
    return spawn(fn, 2, timeout=60)[1]


def test_a_model_without_buffers_sends_only_the_header_and_the_gradient_and_gets_the_parameters():
    numel = sum(p.numel() for p in MLP.parameters())
    assert _one_step_traffic(MLP) == (2, 32 + 8 * numel, 2, 32 + 8 * numel)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_a_model_with_buffers_adds_one_vector_per_kind_each_way_unless_buffers_stay_local(broadcast_buffers):
    """Floating buffers (running statistics) in their dtype, counters as int64; none at all with
    broadcast_buffers=False (each rank keeps its own, as torch DDP does then)."""
    numel = sum(p.numel() for p in BN_NET.parameters())
    statistics = 2 * (6 + 4)  # running_mean and running_var of each BatchNorm
    expected = ((4, 32 + 8 * numel + 8 * statistics + 8 * 2) if broadcast_buffers
                else (2, 32 + 8 * numel))
    assert _one_step_traffic(BN_NET, broadcast_buffers=broadcast_buffers) == expected * 2
