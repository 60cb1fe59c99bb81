"""Buffers in checkpoints as torch's state_dict has them: persistent buffers saved and loaded,
non-persistent ones (caches a module rebuilds) neither saved nor overwritten by a load, so
``consolidate``'s output loads strictly into the unwrapped model."""
import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK, STRATEGIES


class _Cached(nn.Module):
    """A linear layer with a running count (persistent) and a table it rebuilds (not)."""

    def __init__(self, table_length: int, seed: int = 0, persistent_table: bool = False) -> None:
        super().__init__()
        with SEED_LOCK:
            torch.manual_seed(seed)
            self.fc = nn.Linear(4, 3).double()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("table", torch.arange(table_length, dtype=torch.float64),
                             persistent=persistent_table)

    def forward(self, x):
        if self.training:
            self.count += 1
        return self.fc(x) + self.table[:3]


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _wrap(strategy, module, backend):
    if strategy == "hybrid":
        return HybridShardedModel(module, backend, dims=ParallelDims(dp=backend.world_size))
    return STRATEGIES[strategy][0](module, backend)


def _save(backend, strategy, path):
    model = _wrap(strategy, _Cached(5), backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if strategy == "hybrid" else \
        STRATEGIES[strategy][1](model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(backend.rank)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    model.train_step((x, y), _mse, opt)
    checkpoint.save(path, model, opt, step=1)
    return model.gather_full_parameters()


def _load(backend, strategy, path):
    model = _wrap(strategy, _Cached(7, seed=9), backend)  # another cache length, other weights
    checkpoint.load(path, model)
    return model.gather_full_parameters(), model.module.table.clone()


@pytest.mark.parametrize("saved_by, loaded_by", [("ddp", "zero3"), ("zero2", "fsdp"), ("zero3", "ddp"),
                                                 ("hybrid", "zero1"), ("zero1", "hybrid")])
def test_non_persistent_buffers_are_not_saved_and_consolidate_loads_strictly(tmp_path, saved_by, loaded_by):
    # They were saved: consolidate's dict then held a key the unwrapped model's strict
    # load_state_dict refused, and loading into a model whose cache has another length failed.
    path = tmp_path / "ckpt"
    saved = spawn(lambda b: _save(b, saved_by, path), 2, timeout=30)[0]
    assert "table" not in saved and saved["count"].item() == 1
    consolidated = checkpoint.consolidate(path)
    assert sorted(consolidated) == sorted(saved)
    plain = _Cached(5, seed=9)
    plain.load_state_dict(consolidated)  # strict
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    for full, table in spawn(lambda b: _load(b, loaded_by, path), 2, timeout=30):
        torch.testing.assert_close(table, torch.arange(7, dtype=torch.float64), rtol=0, atol=0)
        for name, value in saved.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)


def test_a_saved_buffer_that_this_model_does_not_persist_is_left_as_the_model_has_it(tmp_path):
    # Checkpoints saved before non-persistent buffers were left out hold them: they still load.
    path = tmp_path / "ckpt"

    def save(backend):
        model = STRATEGIES["zero2"][0](_Cached(5, persistent_table=True), backend)
        checkpoint.save(path, model, step=0)
        return model.gather_full_parameters()
    saved = spawn(save, 2, timeout=30)[0]
    assert "table" in checkpoint.consolidate(path)
    for full, table in spawn(lambda b: _load(b, "zero3", path), 2, timeout=30):
        torch.testing.assert_close(table, torch.arange(7, dtype=torch.float64), rtol=0, atol=0)
        for name, value in full.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
