"""memory_footprint() under GradientCompressionOptimizer counts what error feedback keeps.

The error-feedback residuals (one more copy of the gradients) and PowerSGD's warm-start factors
are optimizer state in all but name, and the model's footprint left them out: 296 bytes of
optimizer state with TopK's residuals or without them."""
import copy

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import PowerSGDCompressor, TopKCompressor
from tests.optimizers.test_compression_optimizer import MLP, _batch


def _storage(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("compressor", [TopKCompressor(0.3), PowerSGDCompressor(rank=1, start_iter=0)],
                         ids=repr)
def test_the_footprint_counts_residuals_and_warm_starts(compressor):
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9,
                                           compressor=copy.deepcopy(compressor))
        for step in range(2):
            model.train_step(_batch(step, b.rank, 2), nn.functional.mse_loss, opt)
        momentum = [v for s in opt.wrapped_optimizer.state.values() for v in s.values()]
        kept = [*opt.residuals.values(), *opt.compressor.state_dict().values()]
        return model.memory_footprint()["optimizer_state"], _storage(momentum), _storage(kept)

    for counted, momentum, kept in spawn(fn, 2, timeout=60):
        assert kept > 0 and counted == momentum + kept
