"""Compressors on their own: round trips, error bounds, PowerSGD's orthogonalisation and shape
rule, payload bytes, settings errors. Pure math, no communication."""
import math

import pytest
import torch

from distframe.errors import ConfigError
from distframe.optimizers.compression import (
    BF16Compressor,
    FP16Compressor,
    IdentityCompressor,
    Int8Compressor,
    PowerSGDCompressor,
    TopKCompressor,
    make_compressor,
)


def _tensor(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _payload_bytes(payload):
    return sum(t.nbytes for t in payload)


def test_identity_is_exact_and_lossless():
    t = _tensor(5, 7)
    payload, ctx = IdentityCompressor().compress(t)
    assert torch.equal(IdentityCompressor().decompress(payload, ctx), t)
    assert not IdentityCompressor.lossy and _payload_bytes(payload) == t.nbytes


@pytest.mark.parametrize("compressor, wire", [(FP16Compressor(), torch.float16),
                                              (BF16Compressor(), torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cast_round_trip_equals_the_cast(compressor, wire, dtype):
    t = _tensor(33, 9, dtype=dtype)
    payload, ctx = compressor.compress(t)
    assert payload[0].dtype == wire and _payload_bytes(payload) == t.numel() * 2
    out = compressor.decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t.to(wire).to(dtype))


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1024])
@pytest.mark.parametrize("shape", [(1,), (100,), (13, 11)])
def test_int8_nearest_error_is_at_most_half_a_step(chunk_size, shape):
    t = _tensor(*shape, seed=chunk_size)
    comp = Int8Compressor(chunk_size=chunk_size, stochastic=False)
    (q, scales), ctx = comp.compress(t)
    assert q.dtype == torch.int8 and q.numel() == t.numel()
    assert scales.numel() == math.ceil(t.numel() / chunk_size)
    out = comp.decompress((q, scales), ctx)
    flat = t.reshape(-1)
    step = scales.to(torch.float64).repeat_interleave(chunk_size)[:flat.numel()]
    assert ((out.reshape(-1) - flat).abs() <= step / 2 + 1e-12).all()
    assert int(q.abs().max()) <= 127
    # the element of largest magnitude in each chunk is (nearly) exact
    assert torch.allclose(out.reshape(-1).abs().max(), flat.abs().max(), rtol=1e-6)


@pytest.mark.parametrize("magnitude", [1e-6, 3e-5, 1e-3, 1.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_of_half_precision_gradients_is_within_half_a_step(magnitude, dtype):
    """Before, the scale and the quantisation ran in the gradient's own dtype: an fp16 chunk of
    1e-6 (unscaled fp16 gradients) got scale 0 and sent nothing, one of 3e-5 a subnormal scale
    off by a third. The bound: half a step, plus rounding the result to ``dtype`` (half an ulp)."""
    t = (_tensor(200, seed=7) * magnitude).to(dtype)
    comp = Int8Compressor(chunk_size=50, stochastic=False)
    (q, scales), ctx = comp.compress(t)
    out = comp.decompress((q, scales), ctx)
    assert out.dtype == dtype and scales.dtype == torch.float32
    exact, got = t.to(torch.float64), out.to(torch.float64)
    step = scales.to(torch.float64).repeat_interleave(50)
    finfo = torch.finfo(dtype)
    rounding = finfo.eps / 2 * exact.abs() + finfo.smallest_normal * finfo.eps / 2
    assert ((got - exact).abs() <= step / 2 + rounding).all()
    torch.testing.assert_close(step * 127, exact.view(4, 50).abs().amax(1).repeat_interleave(50),
                               rtol=2.0 ** -23, atol=0.0)


def test_int8_stochastic_rounding_is_unbiased_and_within_one_step():
    t = _tensor(64, seed=3)
    comp = Int8Compressor(chunk_size=16, stochastic=True, seed=5)
    draws = []
    for _ in range(4000):
        payload, ctx = comp.compress(t)
        draws.append(comp.decompress(payload, ctx))
    draws = torch.stack(draws)
    step = payload[1].to(torch.float64).repeat_interleave(16)
    assert ((draws - t).abs() <= step + 1e-12).all()
    # the mean of 4000 draws is within ~5 standard errors (step / 2 / sqrt(4000)) of the truth
    assert ((draws.mean(0) - t).abs() <= 5 * step / 2 / math.sqrt(4000)).all()
    nearest = Int8Compressor(chunk_size=16, stochastic=False)
    biased = nearest.decompress(*nearest.compress(t))
    assert not torch.equal(draws[0], biased)  # it does round randomly


def test_int8_zero_tensor_round_trips_to_zero():
    comp = Int8Compressor(chunk_size=4)
    out = comp.decompress(*comp.compress(torch.zeros(10)))
    assert torch.equal(out, torch.zeros(10))



@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_keeps_a_non_finite_gradient_non_finite(bad, stochastic):
    """An overflowed gradient must arrive non-finite (GradScaler then skips the step and lowers
    the scale), not as finite made-up values: the chunk holding it decompresses to non-finite,
    the other chunks are untouched."""
    comp = Int8Compressor(chunk_size=4, stochastic=stochastic)
    t = _tensor(12)
    t[5] = bad
    out = comp.decompress(*comp.compress(t))
    assert not torch.isfinite(out[4:8]).any()
    for lo in (0, 8):
        assert (out[lo:lo + 4] - t[lo:lo + 4]).abs().max() <= t[lo:lo + 4].abs().max() / 127


@pytest.mark.parametrize("ratio, numel, k", [(0.07, 100, 7), (0.1, 30, 3), (0.3, 10, 3), (0.01, 10, 1),
                                             (1.0, 5, 5), (0.5, 1, 1)])
def test_topk_sends_ceil_of_ratio_times_numel_exactly(ratio, numel, k):
    # 0.07 * 100 is 7.000000000000001 in floating point: ceil sent one element too many.
    assert TopKCompressor(ratio).k_for(numel) == k

@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
def test_topk_keeps_the_largest_magnitudes(ratio):
    t = _tensor(20, 10, seed=1)
    comp = TopKCompressor(ratio)
    (values, indices), ctx = comp.compress(t)
    k = max(1, math.ceil(ratio * t.numel()))
    assert values.numel() == k and indices.dtype == torch.int32
    assert _payload_bytes((values, indices)) == k * (8 + 4)
    out = comp.decompress((values, indices), ctx)
    kept = out != 0
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], t[kept])
    if k < t.numel():
        assert t[kept].abs().min() >= t[~kept].abs().max()


def test_powersgd_shape_rule():
    comp = PowerSGDCompressor(rank=4, start_iter=0)
    assert not comp.compressible((100,))               # vectors are never compressed
    assert comp.compressible((32, 32))                  # (32+32)*4*2 = 512 <= 1024
    assert comp.compressible((16, 16))                  # 256 <= 256: exactly half
    assert not comp.compressible((12, 12))              # 192 > 144
    assert not comp.compressible((8, 4, 4))             # viewed as 8 x 16: 192 > 128
    assert comp.compressible((64, 2, 3, 3))             # 64 x 18: (82)*4*2 = 656 <= 1152
    assert PowerSGDCompressor(rank=1, start_iter=0).compressible((4, 4))  # 16 <= 16
    assert not PowerSGDCompressor(rank=1, start_iter=0).compressible((3, 4))  # 14 > 12


def test_powersgd_orthogonalize_gives_orthonormal_columns():
    p = _tensor(50, 4, seed=2)
    q = PowerSGDCompressor.orthogonalize(p.clone())
    assert torch.allclose(q.t() @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    # the same column space: the projection of p onto q reproduces p
    assert torch.allclose(q @ (q.t() @ p), p, atol=1e-12)


def test_powersgd_orthogonalize_zeroes_dependent_columns():
    base = _tensor(10, 1, seed=4)
    p = torch.cat([base, 2 * base, _tensor(10, 1, seed=5)], dim=1)
    q = PowerSGDCompressor.orthogonalize(p)
    assert torch.equal(q[:, 1], torch.zeros(10, dtype=torch.float64))
    assert torch.allclose(q[:, [0, 2]].t() @ q[:, [0, 2]], torch.eye(2, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_powersgd_orthogonalize_zeroes_dependent_float32_columns(seed):
    # In float32, Gram-Schmidt leaves about 1e-7 of a dependent column: a cut-off of 1e-8 of its
    # norm normalised that rounding noise into a second unit column, so P stopped being
    # orthonormal and a rank-1 gradient was approximated with errors of 40% of its norm.
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(64, 1, generator=g)
    p = u @ torch.randn(1, 2, generator=g)  # two dependent columns, float32
    q = PowerSGDCompressor.orthogonalize(p)
    assert torch.equal(q[:, 1], torch.zeros(64))
    assert abs(float(q[:, 0].norm()) - 1.0) < 1e-6


def test_powersgd_reconstructs_a_low_rank_matrix_and_warm_starts():
    a, b = _tensor(40, 2, seed=6), _tensor(2, 30, seed=7)
    m = a @ b  # rank 2
    comp = PowerSGDCompressor(rank=2, start_iter=0)
    (p, q), ctx = comp.compress(m, key="w")
    assert p.shape == (40, 2) and q.shape == (30, 2)
    assert _payload_bytes((p, q)) == (40 + 30) * 2 * 8 < m.nbytes / 2
    assert torch.allclose(comp.decompress((p, q), ctx), m, atol=1e-10)
    saved = comp.state_dict()
    assert set(saved) == {"powersgd_q/w"} and torch.equal(saved["powersgd_q/w"], q)
    fresh = PowerSGDCompressor(rank=2, start_iter=0)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.warm_start("w", m.shape, torch.float64), q)


def test_powersgd_power_iteration_converges_with_warm_start():
    m = _tensor(60, 40, seed=8)
    comp = PowerSGDCompressor(rank=1, start_iter=0)
    errors = [(comp.decompress(*comp.compress(m, key="w")) - m).norm() for _ in range(30)]
    best = torch.linalg.svdvals(m)[1:].square().sum().sqrt()  # the optimal rank-1 error
    assert errors[-1] < errors[0]
    assert errors[-1] == pytest.approx(float(best), rel=1e-3)


def test_powersgd_passes_uncompressible_tensors_unchanged_and_seeds_alike():
    comp = PowerSGDCompressor(rank=2, start_iter=3)
    v = _tensor(7)
    payload, ctx = comp.compress(v)
    assert torch.equal(comp.decompress(payload, ctx), v)
    assert not comp.is_active(2) and comp.is_active(3)
    other = PowerSGDCompressor(rank=2, start_iter=3)
    shape = torch.Size([20, 20])
    assert torch.equal(comp.warm_start("x", shape, torch.float64), other.warm_start("x", shape, torch.float64))
    assert not torch.equal(comp.warm_start("x", shape, torch.float64), comp.warm_start("y", shape, torch.float64))


@pytest.mark.parametrize("make, field", [
    (lambda: TopKCompressor(0), "ratio"), (lambda: TopKCompressor(1.5), "ratio"),
    (lambda: Int8Compressor(chunk_size=0), "chunk_size"),
    (lambda: PowerSGDCompressor(rank=0), "rank"), (lambda: PowerSGDCompressor(1, start_iter=-1), "start_iter"),
    (lambda: make_compressor("gzip"), "compressor"), (lambda: make_compressor("topk", rank=2), "topk"),
])
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_make_compressor_by_name():
    assert isinstance(make_compressor("none"), IdentityCompressor)
    assert make_compressor("topk", ratio=0.2).ratio == 0.2
    psgd = make_compressor("powersgd", rank=3, start_iter=7)
    assert (psgd.rank, psgd.start_iter) == (3, 7)


def test_int8_rounding_noise_is_independent_across_ranks():
    # Ranks drawing the same noise round the same elements the same way, so their errors do not
    # average out over ranks; bind(rank) (GradientCompressionOptimizer calls it) seeds with both.
    x = torch.linspace(-1, 1, 4096, dtype=torch.float64)

    def levels(rank):
        return _round_trip(rank, x)[0][0]
    assert torch.equal(levels(1), levels(1))  # deterministic per (seed, rank)
    assert not torch.equal(levels(0), levels(1))
    errors = [Int8Compressor().decompress(*_round_trip(rank, x)) - x for rank in range(4)]
    mean_error = torch.stack(errors).mean(0)
    # Independent zero-mean errors: the mean over 4 ranks has about half the spread of one.
    assert float(mean_error.std()) < 0.7 * float(errors[0].std())


def _round_trip(rank, x):
    compressor = Int8Compressor(seed=7)
    compressor.bind(rank)
    return compressor.compress(x)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**40), 10**15])
def test_seeds_of_any_size_are_taken(seed):
    # The seed is mixed with the rank (int8) or the parameter's name (PowerSGD's first Q); the
    # mix once overflowed torch's 64-bit seed for seeds above about 1.8e13 (--seed 10**15).
    int8 = Int8Compressor(seed=seed)
    int8.bind(3)
    int8.compress(torch.randn(10))
    powersgd = PowerSGDCompressor(rank=1, start_iter=0, seed=seed)
    powersgd.warm_start("w", torch.Size([4, 4]), torch.float64)
