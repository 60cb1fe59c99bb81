"""train_step(..., accumulation_steps=N): the slice in N equal pieces, one forward and backward at
a time, synchronised once. Equal to single-process training on the whole batch (float64, 1e-10)
for every strategy, a pipeline and gradient compression; the returned loss is the batch's."""
import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import PipelineParallelModel
from distframe.optimizers import GradientCompressionOptimizer
from distframe.optimizers.compression import IdentityCompressor
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

STEPS, BATCH = 3, 12


def reference_losses(batches):
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world,pieces", [(1, 4), (2, 3), (3, 2)])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_accumulation_trains_as_one_process(strategy, world, pieces):
    batches = global_batches(STEPS, BATCH)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        losses = [model.train_step(rank_slice(b, backend.rank, world), loss_fn, opt,
                                   accumulation_steps=pieces) for b in batches]
        return losses, model.gather_full_parameters(), dict(backend.stats.calls)

    expected, losses = reference_run(batches)[-1], reference_losses(batches)
    for got, params, calls in spawn(run, world):
        assert got == pytest.approx(losses, rel=1e-12)
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


def test_accumulation_synchronises_once_per_step():
    def calls(pieces):
        def run(backend):
            model = STRATEGIES["zero2"][0](build_model(), backend, **SETTINGS["zero2"])
            opt = STRATEGIES["zero2"][1](model, torch.optim.Adam, lr=1e-2)
            backend.stats.reset()
            model.train_step(rank_slice(global_batches(1, BATCH)[0], backend.rank, 2), loss_fn, opt,
                             accumulation_steps=pieces)
            return dict(backend.stats.calls)
        return spawn(run, 2)[0]

    assert calls(3) == calls(1)


def test_pipeline_and_compression_accumulate_as_one_process():
    batches = global_batches(STEPS, BATCH)
    expected = reference_run(batches)[-1]

    def pipeline(backend):
        model = PipelineParallelModel(build_model(), backend, num_microbatches=2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for batch in batches:
            model.train_step(batch, loss_fn, opt, accumulation_steps=3)
        return model.gather_full_parameters()

    def compressed(backend):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        opt = GradientCompressionOptimizer(model, torch.optim.Adam, compressor=IdentityCompressor(),
                                           lr=1e-2)
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, 2), loss_fn, opt, accumulation_steps=2)
        return model.gather_full_parameters()

    for params in spawn(pipeline, 2) + spawn(compressed, 2):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


def test_pieces_that_do_not_divide_the_slice_are_refused():
    def run(backend):
        model = STRATEGIES["ddp"][0](nn.Linear(2, 1).double(), backend)
        opt = STRATEGIES["ddp"][1](model, torch.optim.SGD, lr=0.1)
        batch = (torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64))
        for steps, match in ((2, "must divide dim 0"), (0, "integer >= 1")):
            with pytest.raises(ConfigError, match=match):
                model.train_step(batch, loss_fn, opt, accumulation_steps=steps)
        return True

    assert all(spawn(run, 2))


def test_a_pipeline_slice_that_pieces_and_micro_batches_cannot_divide_names_both():
    # 8 samples in 2 pieces of 4, then 3 micro-batches each: the slice must be a multiple of 6
    def run(backend):
        model = PipelineParallelModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).double(), backend,
                                      num_microbatches=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = (torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))
        with pytest.raises(ConfigError, match=r"num_microbatches=3 = 6 .* multiple of 6 samples"):
            model.train_step(batch, loss_fn, opt, accumulation_steps=2)
        return True

    assert all(spawn(run, 2))
