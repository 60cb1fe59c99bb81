"""Compressor settings that are not what they must be are ConfigErrors naming the setting, and a
stateful compressor serves one rank."""
import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel
from distframe.optimizers import GradientCompressionOptimizer
from distframe.optimizers.compression import (FP16Compressor, Int8Compressor, PowerSGDCompressor,
                                              make_compressor)
from tests.models.common import build_model, global_batches, loss_fn, rank_slice


@pytest.mark.parametrize("seed", [1.7, "7", None, True])
@pytest.mark.parametrize("build", [lambda s: Int8Compressor(seed=s), lambda s: PowerSGDCompressor(seed=s),
                                   lambda s: make_compressor("int8", seed=s)])
def test_a_seed_that_is_not_an_int_is_a_config_error(build, seed):
    """Before, 1.7 silently became 1, "7" became 7 and None raised a bare TypeError."""
    with pytest.raises(ConfigError, match=r"\.seed=.*use an int"):
        build(seed)


def _train_one_step(backend, compressor):
    model = DDPModel(build_model(), backend)
    opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.1, compressor=compressor)
    x, y = rank_slice(global_batches(1, 8)[0], backend.rank, backend.world_size)
    model.train_step((x, y), loss_fn, opt)
    return True


@pytest.mark.parametrize("build", [lambda: Int8Compressor(seed=3), lambda: PowerSGDCompressor(rank=1)])
def test_one_stateful_compressor_for_every_rank_is_refused(build):
    # In-memory ranks are threads: a compressor built outside the rank function reached all of
    # them, which raced on its rounding generator or warm start without a word.
    shared = build()
    with pytest.raises(ConfigError, match="already serves rank .*copy.deepcopy"):
        spawn(lambda b: _train_one_step(b, shared), 2)


def test_stateless_compressors_and_later_runs_may_share():
    shared = FP16Compressor()
    assert spawn(lambda b: _train_one_step(b, shared), 2) == [True, True]
    stateful = Int8Compressor(seed=3)
    assert spawn(lambda b: _train_one_step(b, stateful), 1) == [True]
    # The rank that held it has shut down: a later run's rank may take it.
    fresh = Int8Compressor(seed=3)
    assert spawn(lambda b: _train_one_step(b, stateful if b.rank == 1 else fresh), 2) == [True, True]
