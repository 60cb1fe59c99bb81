"""PowerSGD's orthogonalisation on ill-conditioned inputs, and what it means for training.

Before, one pass of modified Gram-Schmidt kept a column whose remainder was just above the
cut-off (1000 units in the last place of its norm), but such a column had lost orthogonality by
about eps / remainder: for a rank-2 matrix plus 1e-12 noise, max |P^T P - I| was 3e-4. P P^T M
was then no projection, so PowerSGD whose rank exceeds the gradient's, which should be exact,
drifted from one-process training by 5e-6 in 5 float64 steps (rank 2 on the same gradients:
1.6e-13). Now every kept column is orthonormal to rounding, and a dependent one is zero."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import PowerSGDCompressor


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _check_orthonormal_and_spanning(p, q, kept, tolerance):
    """The ``kept`` columns of ``q`` are orthonormal, the others exactly zero, and the kept
    ones span what ``p`` spans (to ``tolerance``, relative)."""
    zero = [i for i in range(q.shape[1]) if i not in kept]
    assert torch.equal(q[:, zero], torch.zeros_like(q[:, zero]))
    ours = q[:, kept]
    eye = torch.eye(len(kept), dtype=q.dtype)
    assert (ours.t() @ ours - eye).abs().max().item() <= tolerance
    assert (ours @ (ours.t() @ p) - p).norm().item() <= tolerance * p.norm().item()


@pytest.mark.parametrize("dtype, gap, tolerance", [
    (torch.float64, 1e-4, 1e-14), (torch.float64, 1e-9, 1e-14), (torch.float64, 1e-12, 1e-14),
    (torch.float32, 1e-2, 2e-6), (torch.float32, 1e-3, 2e-6)])
def test_a_nearly_dependent_column_is_kept_orthonormal(dtype, gap, tolerance):
    """Columns a, b, 2a - b + gap * noise: the third is kept (its remainder is above the
    cut-off), and it is orthogonal to the others to rounding, not to eps / gap."""
    a, b, noise = (_randn(40, 1, seed=s, dtype=dtype) for s in (1, 2, 3))
    p = torch.cat([a, b, 2 * a - b + gap * noise.norm().reciprocal() * (2 * a - b).norm() * noise], dim=1)
    q = PowerSGDCompressor.orthogonalize(p.clone())
    _check_orthonormal_and_spanning(p, q, [0, 1, 2], tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gap", [0.0, 10.0])
def test_a_dependent_column_is_zero(dtype, gap):
    """Within ``gap`` ulps of dependent (below the 1000-ulp cut-off): zero, the others orthonormal."""
    a, b, noise = (_randn(40, 1, seed=s, dtype=dtype) for s in (4, 5, 6))
    third = 2 * a - b
    third = third + gap * torch.finfo(dtype).eps * third.norm() * noise / noise.norm()
    p = torch.cat([a, b, third], dim=1)
    q = PowerSGDCompressor.orthogonalize(p.clone())
    _check_orthonormal_and_spanning(p, q, [0, 1], 20 * torch.finfo(dtype).eps)


def test_a_low_rank_matrix_plus_tiny_noise_is_projected_as_qr_does():
    """The reviewer's case: P = M Q for a rank-2 M plus 1e-12 noise and a rank-3 Q."""
    g = torch.Generator().manual_seed(1)
    u, v, noise, q = (torch.randn(*shape, generator=g, dtype=torch.float64)
                      for shape in [(16, 2), (2, 16), (16, 16), (16, 3)])
    m = u @ v + 1e-12 * noise
    p = m @ q
    q = PowerSGDCompressor.orthogonalize(p.clone())
    kept = [i for i in range(3) if q[:, i].abs().max() > 0]
    _check_orthonormal_and_spanning(p, q, kept, 1e-14)
    qr = torch.linalg.qr(p).Q
    ours, theirs = (q @ (q.t() @ m) - m).abs().max(), (qr @ (qr.t() @ m) - m).abs().max()
    assert ours <= 10 * theirs + 1e-14


@pytest.mark.parametrize("columns", [4, 6])
def test_graded_hilbert_columns_are_orthonormal(columns):
    """Columns of a Hilbert matrix (condition number up to 1e7 here): orthonormal to rounding."""
    i = torch.arange(30, dtype=torch.float64).unsqueeze(1)
    p = 1.0 / (i + torch.arange(columns, dtype=torch.float64) + 1)
    q = PowerSGDCompressor.orthogonalize(p.clone())
    _check_orthonormal_and_spanning(p, q, list(range(columns)), 1e-14)


# ---- training ----------------------------------------------------------------------------------
torch.manual_seed(0)
# One sample per rank at 2 ranks: each weight's averaged gradient has rank 2 or less.
MLP = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False)).double()
WORLD, STEPS = 2, 5


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(WORLD, 16, generator=g, dtype=torch.float64),
            torch.randn(WORLD, 16, generator=g, dtype=torch.float64))


def _one_process(opt_cls, **kw):
    model = copy.deepcopy(MLP)
    opt = opt_cls(model.parameters(), **kw)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("opt_cls, kw", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                         (torch.optim.Adam, dict(lr=0.01))], ids=["sgd", "adam"])
def test_powersgd_of_rank_at_least_the_gradients_equals_one_process(rank, opt_cls, kw):
    """Exact to float64 rounding (the correctness contract's 1e-10). Every rank orthogonalises
    the same summed P, bitwise, and so keeps and drops the same columns."""
    def fn(b):
        compressor = PowerSGDCompressor(rank=rank, start_iter=0)
        seen = []

        def spy(p, eps=None):
            given = p.clone()
            out = PowerSGDCompressor.orthogonalize(p, eps)
            seen.append((given, out.clone()))
            return out
        compressor.orthogonalize = spy
        model = DDPModel(copy.deepcopy(MLP), b, bucket_cap_mb=0.0005)
        opt = GradientCompressionOptimizer(model, opt_cls, compressor=compressor, **kw)
        for step in range(STEPS):
            x, y = _batch(step)
            model.train_step((x[b.rank:b.rank + 1], y[b.rank:b.rank + 1]), nn.functional.mse_loss, opt)
        return model.gather_full_parameters(), seen
    out = spawn(fn, WORLD, timeout=60)
    expected = _one_process(opt_cls, **kw)
    params, seen = out[0]
    assert len(seen) == 2 * STEPS
    for name in expected:
        assert (params[name] - expected[name]).abs().max().item() <= 1e-10
    for other_params, other_seen in out[1:]:
        assert all(torch.equal(params[k], other_params[k]) for k in params)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(seen, other_seen))
