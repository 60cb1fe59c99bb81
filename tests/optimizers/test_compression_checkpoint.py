"""GradientCompressionOptimizer through distframe.checkpoint on disk (in-memory engine, float64).

Before, a checkpoint of PowerSGD saved after its start_iter at 2 ranks or more could not be
loaded ("no single stored compression.powersgd_q piece"): every rank wrote the warm-start
factors, which are the same on every rank, under one key into its own file, and the warm start
is read as one whole piece. The tests that merged the ranks' state dicts in memory dropped the
duplicates and missed it. Now rank 0 alone writes the state every rank holds alike."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint, spawn
from distframe.checkpoint.format import read_metadata
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import (FP16Compressor, Int8Compressor, PowerSGDCompressor,
                                              TopKCompressor)

torch.manual_seed(3)
# 24 x 12 and 16 x 24 weights are compressible at PowerSGD rank 2; the 3 x 16 one is not.
MLP = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 3)).double()
SAVED_AT, STEPS = 3, 5


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = torch.randn(12, 3, generator=g, dtype=torch.float64)
    n = 12 // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _build(b, compressor):
    model = DDPModel(copy.deepcopy(MLP), b, bucket_cap_mb=0.001)
    return model, GradientCompressionOptimizer(model, torch.optim.Adam, lr=0.01,
                                               compressor=copy.deepcopy(compressor))


def _train(model, opt, first, last):
    b = model.backend
    for step in range(first, last):
        model.train_step(_batch(step, b.rank, b.world_size), nn.functional.mse_loss, opt)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("compressor", [PowerSGDCompressor(rank=2, start_iter=2),
                                        PowerSGDCompressor(rank=1, start_iter=0), TopKCompressor(0.1),
                                        Int8Compressor(chunk_size=32), FP16Compressor()], ids=repr)
def test_a_resumed_run_equals_the_uninterrupted_one_bitwise(tmp_path, compressor):
    def fn(b):
        model, opt = _build(b, compressor)
        _train(model, opt, 0, SAVED_AT)
        checkpoint.save(tmp_path / "ck", model, opt, step=SAVED_AT)
        _train(model, opt, SAVED_AT, STEPS)
        straight = model.gather_full_parameters()
        model, opt = _build(b, compressor)
        checkpoint.load(tmp_path / "ck", model, opt)
        assert opt.iteration == SAVED_AT
        _train(model, opt, SAVED_AT, STEPS)
        return _equal(model.gather_full_parameters(), straight)
    assert spawn(fn, 2, timeout=60) == [True, True]


def test_powersgd_factors_are_written_once_and_load_at_any_world_size(tmp_path):
    """The warm-start factors are the same on every rank: rank 0's file holds them, the others'
    do not, and every rank of a run of another size loads them (the residuals are re-dealt, see
    test_compression_reshard.py); its ranks then stay bitwise alike."""
    compressor = PowerSGDCompressor(rank=2, start_iter=1)

    def first(b):
        model, opt = _build(b, compressor)
        _train(model, opt, 0, SAVED_AT)
        checkpoint.save(tmp_path / "ck", model, opt, step=SAVED_AT)
        return opt.compressor.state_dict()

    saved = spawn(first, 2, timeout=60)
    assert saved[0] and _equal(saved[0], saved[1])
    held = [sorted(entry["tensors"]) for entry in read_metadata(tmp_path / "ck")["files"]]
    warm = [[k for k in keys if k.startswith("compression.powersgd_q/")] for keys in held]
    assert len(warm[0]) == len(saved[0]) and warm[1] == []
    assert all(not any(k.startswith("compression.iteration/") for k in keys) for keys in held[1:])

    def second(b):
        model, opt = _build(b, compressor)
        checkpoint.load(tmp_path / "ck", model, opt)
        loaded = opt.compressor.state_dict()
        _train(model, opt, SAVED_AT, STEPS)
        return opt.iteration, loaded, model.gather_full_parameters()
    for world in (1, 3):
        out = spawn(second, world, timeout=60)
        for iteration, loaded, params in out:
            assert iteration == STEPS and _equal(loaded, saved[0])
            assert _equal(params, out[0][2])
