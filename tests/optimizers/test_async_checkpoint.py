"""AsyncSGDOptimizer checkpoints (in-memory engine, float64): the server's parameters and
optimizer state go into the checkpoint, and a deterministic sequential run (max_staleness=0)
saved and resumed equals the uninterrupted run bitwise."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer

torch.manual_seed(3)
MLP = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(worker, k):
    g = torch.Generator().manual_seed(100 * worker + k)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    return x, x[:, :2].cos()


def _build(b, server_rank):
    model = DDPModel(copy.deepcopy(MLP), b)
    # Momentum: optimizer state that only the server's optimizer holds.
    return model, AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9, server_rank=server_rank,
                                    max_staleness=0, deterministic=True)


def _session(b, opt, first, last):
    if opt.is_server:
        opt.serve()
        return
    for k in range(first, last):
        opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
    opt.finish()


@pytest.mark.parametrize("server_rank", [0, 2])
def test_saved_and_resumed_run_equals_the_uninterrupted_one(tmp_path, server_rank):
    """Before, the checkpoint held each rank's 1/3 of the replicated parameters (the workers'
    stale ones) and of the momentum (none on workers), so load failed or resumed elsewhere."""
    def fn(b):
        model, opt = _build(b, server_rank)
        _session(b, opt, 0, 6)
        opt.synchronize_parameters()
        straight = model.gather_full_parameters()
        model, opt = _build(b, server_rank)
        _session(b, opt, 0, 3)
        opt.synchronize_parameters()
        checkpoint.save(tmp_path / "ck", model, opt, step=3)
        model, opt = _build(b, server_rank)
        checkpoint.load(tmp_path / "ck", model, opt)
        _session(b, opt, 3, 6)
        opt.synchronize_parameters()
        return straight, model.gather_full_parameters()
    results = spawn(fn, 3, timeout=60)
    for straight, resumed in results:
        assert straight.keys() == resumed.keys()
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)
        # every rank agrees with the server after synchronize_parameters
        assert all(torch.equal(straight[k], results[server_rank][0][k]) for k in straight)


def test_the_server_state_dict_is_whole_and_synchronize_optimizer_state_replicates_it():
    """The server's state_dict alone holds every element's momentum (it was a 1/world_size
    slice); after synchronize_optimizer_state every worker's optimizer holds the server's."""
    numel = sum(p.numel() for p in MLP.parameters())

    def fn(b):
        model, opt = _build(b, 1)
        _session(b, opt, 0, 2)
        opt.synchronize_optimizer_state()
        momentum = [opt.state[p]["momentum_buffer"] for p in model.local_parameter_shard()]
        pieces = opt.state_dict()["tensors"] if opt.is_server else None
        return momentum, pieces
    results = spawn(fn, 3, timeout=60)
    server_momentum, pieces = results[1]
    assert sum(v.numel() for k, v in pieces.items() if k.startswith("optim.momentum_buffer/")) == numel
    for momentum, _ in results:
        assert all(torch.equal(m, s) for m, s in zip(momentum, server_momentum, strict=True))


def test_saving_stale_worker_parameters_names_the_fix(tmp_path):
    def fn(b):
        model, opt = _build(b, 1)
        _session(b, opt, 0, 2)
        with pytest.raises(ConfigError, match=r"call opt.synchronize_parameters\(\) on every rank"):
            checkpoint.save(tmp_path / "ck", model, opt, step=2)
        return True
    assert spawn(fn, 3, timeout=60) == [True] * 3


def test_synchronizing_while_the_server_still_serves_the_worker_is_a_config_error():
    """A collective on a worker the server still serves could never complete: refused at once."""
    def fn(b):
        model, opt = _build(b, 0)
        if opt.is_server:
            opt.serve()
            return None
        opt.train_step(_batch(b.rank, 0), nn.functional.mse_loss)
        with pytest.raises(ConfigError, match="call finish"):
            opt.synchronize_parameters()
        opt.finish()
        return None
    spawn(fn, 2, timeout=60)


BN_NET = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


@pytest.mark.parametrize("server_rank", [0, 2])
def test_the_checkpoint_holds_the_server_buffers_and_a_resumed_run_equals_the_straight_one(
        tmp_path, server_rank):
    """BatchNorm's running statistics: the server's (which the workers push) go into the
    checkpoint, whichever rank writes the buffers. Before, the server kept its initial ones and
    the checkpoint held rank 0's: the server's initial buffers, or one worker's own."""
    def build(b):
        model = DDPModel(copy.deepcopy(BN_NET), b)
        return model, AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9,
                                        server_rank=server_rank, max_staleness=0, deterministic=True)

    def fn(b):
        model, opt = build(b)
        _session(b, opt, 0, 6)
        opt.synchronize_parameters()
        straight = model.gather_full_parameters()
        model, opt = build(b)
        _session(b, opt, 0, 3)
        served = {k: v.clone() for k, v in model.wrapped_model.named_buffers()}
        opt.synchronize_parameters()
        checkpoint.save(tmp_path / "ck", model, opt, step=3)
        model, opt = build(b)
        checkpoint.load(tmp_path / "ck", model, opt)
        _session(b, opt, 3, 6)
        opt.synchronize_parameters()
        return straight, model.gather_full_parameters(), served
    results = spawn(fn, 3, timeout=60)
    server_buffers = results[server_rank][2]
    saved = checkpoint.consolidate(tmp_path / "ck")
    assert int(server_buffers["1.num_batches_tracked"]) == 6  # 2 workers, 3 steps each
    for name, value in server_buffers.items():
        assert torch.equal(saved[name], value), name
    for straight, resumed, _ in results:
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)
        assert all(torch.equal(straight[k], results[server_rank][0][k]) for k in straight)
