"""Parameters that get no gradient: DDPModel(find_unused_parameters=True) leaves their ``.grad``
None as one process does (and torch DDP with that setting), so AdamW skips them; without it they
are averaged as zeros and the rank warns; flat-shard strategies refuse the setting."""
import contextlib
import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel
from distframe.optimizers import DDPOptimizer
from tests.models.common import SEED_LOCK, STRATEGIES

TOL = 1e-10  # float64: the design's parity tolerance


class Gated(nn.Module):
    """``extra`` runs on the rows whose first feature is positive (on no row of some ranks'
    slices); ``spare`` runs only when asked (on no rank in some steps)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 7)
        self.extra = nn.Linear(7, 3)
        self.spare = nn.Linear(7, 3)
        self.head = nn.Linear(7, 3)

    def forward(self, x, use_spare=False):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        mask = x[:, 0] > 0
        if bool(mask.any()):
            out = out.index_add(0, mask.nonzero()[:, 0], self.extra(h[mask]))
        return out + self.spare(h) if use_spare else out


def make_model():
    with SEED_LOCK:
        torch.manual_seed(0)
        return Gated().double()


def batches(steps, rows):
    """Rank 0's half of each batch has the gate open on every row, the other half on none."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(rows, 5, generator=g, dtype=torch.float64)
        x[:, 0] = x[:, 0].abs() * torch.where(torch.arange(rows) < rows // 2, 1.0, -1.0)
        out.append((x, torch.randn(rows, 3, generator=g, dtype=torch.float64)))
    return out


# `spare` runs in (step, micro-batch) 1, 0 only: AdamW must skip it in steps 0 and 2.
SPARE = {(1, 0)}


def micro_batches(x, y, world, micro, rank=None):
    """Micro-batch k of ``rank``'s slice; for the reference (rank None), micro-batch k of every
    rank's slice together, so both compute the same gradient."""
    xs = [t.chunk(micro) for t in x.chunk(world)]
    ys = [t.chunk(micro) for t in y.chunk(world)]
    if rank is not None:
        return list(zip(xs[rank], ys[rank]))
    return [(torch.cat([xr[k] for xr in xs]), torch.cat([yr[k] for yr in ys])) for k in range(micro)]


def reference(data, world, micro=1):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        for k, (xm, ym) in enumerate(micro_batches(x, y, world, micro)):
            out = model(xm, use_spare=(step, k) in SPARE)
            (nn.functional.mse_loss(out, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def run_ddp(backend, data, micro=1, plain=False, find_unused=True):
    model = DDPModel(make_model(), backend, find_unused_parameters=find_unused)
    opt = (torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1) if plain
           else DDPOptimizer(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1))
    for step, (x, y) in enumerate(data):
        pieces = micro_batches(x, y, backend.world_size, micro, backend.rank)
        for k, (xm, ym) in enumerate(pieces):
            with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
                out = model(xm, use_spare=(step, k) in SPARE)
                (nn.functional.mse_loss(out, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters()


def assert_matches(results, expected):
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("plain", [False, True], ids=["DDPOptimizer", "plain AdamW"])
def test_find_unused_parameters_matches_one_process(world, plain):
    data = batches(3, 12)
    results = spawn(functools.partial(run_ddp, data=data, plain=plain), world)
    assert_matches(results, reference(data, world))


def test_gradients_accumulated_under_no_sync_count_as_used():
    # `spare` runs in the first micro-batch of step 1 only; the synchronising backward gives it
    # nothing, but its gradient from no_sync is a gradient: it must reach the optimizer.
    data = batches(3, 12)
    results = spawn(functools.partial(run_ddp, data=data, micro=2), 2)
    assert_matches(results, reference(data, 2, micro=2))


def test_without_the_setting_the_parameters_move_and_each_rank_warns():
    data = batches(3, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = spawn(functools.partial(run_ddp, data=data, find_unused=False), 2)
    messages = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
    # Rank 1 never opens the gate; both ranks miss `spare` in step 0. One warning per rank.
    assert len(messages) == 2, messages
    assert any("on rank 1" in m and "'extra.weight'" in m for m in messages), messages
    assert all("find_unused_parameters=True" in m for m in messages)
    expected = reference(data, 2)
    moved = (results[0]["spare.weight"] - expected["spare.weight"]).abs().max().item()
    assert moved > 1e-4  # weight decay and momentum moved `spare` in steps 0 and 2


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_flat_shard_strategies_refuse_the_setting(strategy):
    def run(backend):
        model_cls = STRATEGIES[strategy][0]
        with pytest.raises(ConfigError, match="find_unused_parameters applies to DDPModel"):
            model_cls(copy.deepcopy(make_model()), backend, find_unused_parameters=True)
    spawn(run, 2)


def test_hybrid_ddp_keeps_gradients_no_replica_made_none():
    # `spare` never runs (use_spare is never passed); `extra` runs on rank 0's rows only.
    from distframe.mesh import ParallelDims
    from distframe.models import HybridShardedModel

    data = batches(3, 12)
    dense = make_model()
    opt = torch.optim.AdamW(dense.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in data:
        nn.functional.mse_loss(dense(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = dense.state_dict()

    def run(backend):
        model = HybridShardedModel(make_model(), backend, dims=ParallelDims(dp=2),
                                   find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        for x, y in data:
            batch = (x.chunk(2)[backend.rank], y.chunk(2)[backend.rank])
            model.train_step(batch, nn.functional.mse_loss, opt)
        return model.gather_full_parameters()
    assert_matches(spawn(run, 2), expected)

    def zero(backend):
        with pytest.raises(ConfigError, match="find_unused_parameters needs data_parallel='ddp'"):
            HybridShardedModel(make_model(), backend, dims=ParallelDims(dp=2), data_parallel="zero1",
                               find_unused_parameters=True)
    spawn(zero, 2)
