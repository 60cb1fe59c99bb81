"""Peak live tensor storage of a HybridShardedModel step with data_parallel="zero1"/"zero2" against
data_parallel="ddp", and the rounds in which hybrid ZeRO reduces and gathers its flat space.

The peak is counted from real storage (bench/_storage.py's PeakStorage: every op's output on the
step's thread, and everything reachable when the step starts). Ranks are gloo processes, so each
count is one rank's own.
"""
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench._storage import live_peak, reachable_bytes
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from distframe.models.hybrid_zero import ZeroShards
from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer

WIDTH, LAYERS = 128, 4


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _step_peak(backend, data_parallel):
    """(peak live bytes of the third step above what was live before the model was built, bytes
    of the ZeRO master chunk or 0)."""
    torch.set_num_threads(1)
    gc.collect()
    base = reachable_bytes()
    torch.manual_seed(0)
    plan = {f"{i}.up": "column" for i in range(LAYERS)} | {f"{i}.down": "row" for i in range(LAYERS)}
    model = HybridShardedModel(nn.Sequential(*[_MLP() for _ in range(LAYERS)]), backend,
                               dims=ParallelDims(dp=2, tp=2, pp=1), tp_plan=plan, data_parallel=data_parallel)
    zero_optimizer = {"zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(data_parallel)
    optimizer = (torch.optim.SGD(model.parameters(), lr=1e-3) if zero_optimizer is None else
                 zero_optimizer(model, torch.optim.SGD, lr=1e-3))
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0)), torch.zeros(4, WIDTH)
    for _ in range(2):
        model.train_step(batch, F.mse_loss, optimizer)
    peak = live_peak(lambda: model.train_step(batch, F.mse_loss, optimizer)) - base
    chunk = 0 if model.zero is None else model.zero.master.numel() * model.zero.master.element_size()
    return peak, chunk


def _peaks(backend):
    return {mode: _step_peak(backend, mode) for mode in ("ddp", "zero1", "zero2")}


@pytest.mark.gloo
def test_zero_step_peaks_no_higher_than_ddp_plus_the_shards():
    """SGD keeps no state, so a ZeRO rank holds what a ddp rank holds plus its master chunk and
    that chunk's gradient: its peak may exceed DDP's by those two, no more. It exceeded it by a
    further full copy of the parameters when the flat gradients were copied while every .grad was
    kept, reduce-scattered in one piece (which Gloo copies again) and the updated chunks gathered
    into a full-size tensor."""
    for rank, peaks in enumerate(spawn(_peaks, 4, "gloo", timeout=120)):
        ddp, _ = peaks["ddp"]
        for mode in ("zero1", "zero2"):
            peak, chunk = peaks[mode]
            assert chunk > 0
            assert peak <= ddp + 2 * chunk, (
                f"rank {rank} {mode}: peak live storage {peak} bytes, above data_parallel='ddp' "
                f"({ddp}) plus the master chunk and its gradient (2 x {chunk})")


def _awkward_tensors():
    """Values of parameters of awkward sizes: one empty, one non-contiguous (a transpose)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, dtype=torch.float64, generator=g), torch.zeros(0, dtype=torch.float64),
            torch.randn(4, 7, dtype=torch.float64, generator=g).t(),
            torch.randn(11, dtype=torch.float64, generator=g)]


def _reduce_and_gather(backend, stage, cap):
    """ZeroShards over the awkward parameters: what reduce_gradients leaves in the gradients and
    gather_parameters in the parameters, after each rank's master chunk moved by 100 x (rank + 1)."""
    params = [nn.Parameter(p) for p in _awkward_tensors()]
    shards = ZeroShards(params, backend, stage=stage, bucket_cap_bytes=cap)
    grads = [torch.full_like(p, float(backend.rank + 1)) * (i + 1) for i, p in enumerate(params)]
    grads[1] = None  # a parameter without a gradient counts as zeros
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    shards.reduce_gradients()
    reduced = (shards.master.grad.clone(), [None if p.grad is None else p.grad.clone() for p in params])
    with torch.no_grad():
        shards.master.add_(100.0 * (backend.rank + 1))
    shards.gather_parameters()
    return shards.lo, shards.chunk, reduced, [p.detach().clone() for p in params]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("cap", [8, 40, None])  # rounds of 1 and 2 elements; a quarter of the chunk
def test_rounds_reduce_and_gather_the_whole_flat_space(stage, cap):
    """Rounds that cut through parameters (an empty one, a non-contiguous one, the padding) give
    each rank the average of its chunk and every rank the updated chunks, exactly."""
    originals = _awkward_tensors()
    sizes = [p.numel() for p in originals]
    total = sum(sizes)
    flat = torch.cat([p.reshape(-1) for p in originals])
    flat_grad = torch.cat([torch.full((n,), float(i + 1) * 1.5) for i, n in enumerate(sizes)]).double()
    flat_grad[sizes[0]:sum(sizes[:2])] = 0  # parameter 1 has no gradient
    results = spawn(functools.partial(_reduce_and_gather, stage=stage, cap=cap), 2)
    for rank, (lo, chunk, (master_grad, grads), gathered) in enumerate(results):
        padded = torch.cat([flat_grad, flat_grad.new_zeros(2 * chunk - total)])
        torch.testing.assert_close(master_grad, padded[lo:lo + chunk], rtol=0, atol=1e-12)
        if stage == 2:
            assert all(g is None for g in grads)
        else:  # this rank's own gradients, its chunk replaced by the average
            own = [torch.full((n,), float(rank + 1) * (i + 1)).double() for i, n in enumerate(sizes)]
            own[1].zero_()
            expected = torch.cat(own + [flat_grad.new_zeros(2 * chunk - total)])
            expected[lo:lo + chunk] = padded[lo:lo + chunk]
            got = torch.cat([g.reshape(-1) for g in grads] + [flat_grad.new_zeros(2 * chunk - total)])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        shifted = flat.clone()
        shifted[:chunk] += 100.0  # rank 0's chunk, then rank 1's
        shifted[chunk:] += 200.0
        got = torch.cat([p.reshape(-1) for p in gathered])
        torch.testing.assert_close(got, shifted, rtol=0, atol=1e-12)
        assert gathered[2].shape == (7, 4)


def _round_elements(backend, bucket_cap_mb):
    model = HybridShardedModel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), backend,
                               dims=ParallelDims(dp=2, tp=1, pp=1), data_parallel="zero1",
                               bucket_cap_mb=bucket_cap_mb)
    return model.zero.round


def test_bucket_cap_mb_bounds_a_round():
    # float32, dp 2: a cap of 1 KiB is 128 elements of every rank's chunk per round.
    assert spawn(functools.partial(_round_elements, bucket_cap_mb=1 / 1024), 2) == [128, 128]
    chunk = (2 * (64 * 64 + 64)) // 2
    assert spawn(functools.partial(_round_elements, bucket_cap_mb=25), 2) == [-(-chunk // 4)] * 2
