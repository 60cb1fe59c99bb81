"""Every data-parallel strategy trains exactly like one process on the whole batch."""
import pytest
import torch

from distframe.launch import spawn
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

STEPS = 10


def train_and_record(backend, strategy: str, dtype, steps: int = STEPS, batch: int = 12):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(dtype), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    history, losses = [], []
    for global_batch in global_batches(steps, batch, dtype):
        losses.append(model.train_step(rank_slice(global_batch, backend.rank, backend.world_size),
                                       loss_fn, opt))
        history.append(model.gather_full_parameters())
    return history, losses


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_float64(strategy, world):
    results = spawn(lambda b: train_and_record(b, strategy, torch.float64), world, timeout=60)
    reference = reference_run(global_batches(STEPS, 12))
    for step, expected in enumerate(reference):
        for rank, (history, _) in enumerate(results):
            for name, value in expected.items():
                torch.testing.assert_close(history[step][name], value, rtol=0, atol=1e-10,
                                           msg=lambda m: f"step {step} rank {rank} {name}: {m}")
    assert len({tuple(losses) for _, losses in results}) == 1


@pytest.mark.parametrize("strategy, settings", [
    ("zero3", {"replicate_below_numel": 100}),      # small modules stay gathered between steps
    ("zero3", {"prefetch": False}),
    ("fsdp", {"auto_wrap_min_params": 100, "reshard_after_forward": False}),
    ("fsdp", {"auto_wrap_policy": lambda module, name: name in ("1", "2")}),
])
def test_parity_of_sharding_options(strategy, settings):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(4, 12):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()
    expected = reference_run(global_batches(4, 12))[-1]
    for params in spawn(run, 3):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
