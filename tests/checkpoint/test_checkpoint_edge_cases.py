"""Checkpoints of models the main grid does not build: one-element shards, buffers of another
shape, parameters frozen on one side only."""
import copy

import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES


def _one_output_model() -> nn.Module:
    # Three parameters in all; the bias has one element (a regression head): under DDP its Adam
    # state is one element, and at world size 3 every flat shard is one element.
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 1)).double()


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 2, generator=g, dtype=torch.float64)
    y = torch.randn(12, 1, generator=g, dtype=torch.float64)
    per = 12 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _train(backend, strategy, steps, load_from=None, save_to=None, build=_one_output_model):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build(), backend)
    opt = opt_cls(model, torch.optim.Adam, lr=0.1)
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    for step in steps:
        model.train_step(_batch(step, backend.rank, backend.world_size), _mse, opt)
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=steps[-1] + 1)
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("save_world, load_world", [(3, 3), (3, 1), (1, 3), (3, 2)])
def test_one_element_optimizer_state_round_trips(tmp_path, strategy, save_world, load_world):
    # One-element state (Adam's exp_avg of a one-element shard) was stored as a scalar like
    # Adam's step, so loading it failed or made a 0-d moment that the next step could not use.
    path = tmp_path / "ckpt"
    spawn(lambda b: _train(b, strategy, [0, 1], save_to=path), save_world, timeout=30)
    resumed = spawn(lambda b: _train(b, strategy, [2, 3], load_from=path), load_world, timeout=30)
    expected = spawn(lambda b: _train(b, strategy, [0, 1, 2, 3]), 1, timeout=30)[0]
    for params in resumed:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


class _Temperature(nn.Module):
    """A linear layer times a learned 0-dim parameter: its Adam moments are 0-dim under DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _one_output_model()
        self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.temperature


@pytest.mark.parametrize("saved, loaded", [("ddp", s) for s in STRATEGIES] + [("zero1", "ddp"),
                                                                                ("fsdp", "ddp")])
@pytest.mark.parametrize("save_world, load_world", [(2, 3), (1, 2)])
def test_a_zero_dim_parameters_optimizer_state_round_trips(tmp_path, saved, loaded, save_world, load_world):
    # The 0-dim parameter's exp_avg was stored as a scalar like Adam's step, so every load of an
    # Adam checkpoint from DDP found no exp_avg pieces for it (a KeyError), DDP's own included.
    path = tmp_path / "ckpt"
    spawn(lambda b: _train(b, saved, [0, 1], save_to=path, build=_Temperature), save_world, timeout=30)
    resumed = spawn(lambda b: _train(b, loaded, [2, 3], load_from=path, build=_Temperature), load_world,
                    timeout=30)
    expected = spawn(lambda b: _train(b, "ddp", [0, 1, 2, 3], build=_Temperature), 1, timeout=30)[0]
    for params in resumed:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


class _Scaled(nn.Module):
    """A linear layer and a buffer of ``width`` elements; ``extra`` adds a parameter."""

    def __init__(self, width: int = 4, extra: bool = False, seed: int = 0) -> None:
        super().__init__()
        with SEED_LOCK:
            torch.manual_seed(seed)
            self.lin = nn.Linear(3, 2).double()
            self.extra = nn.Linear(2, 2).double() if extra else None
        self.register_buffer("scale", torch.arange(width, dtype=torch.float64) + 1)

    def forward(self, x):
        return self.lin(x) * self.scale.sum()


def _save_then_load(tmp_path, saved: nn.Module, loaded_factory, strategy="zero1", world=2):
    """Saves a copy of ``saved`` on every rank, loads it into ``loaded_factory()``; per rank:
    (the load's exception or None, the parameters before the load, the parameters after)."""
    path = tmp_path / "ckpt"

    def run(backend):
        checkpoint.save(path, STRATEGIES[strategy][0](copy.deepcopy(saved), backend))
        model = STRATEGIES[strategy][0](loaded_factory(), backend)
        before, error = model.gather_full_parameters(), None
        try:
            checkpoint.load(path, model)
        except Exception as exc:  # noqa: BLE001 - returned to the test to inspect
            error = exc
        return error, before, model.gather_full_parameters()
    return spawn(run, world, timeout=30)


@pytest.mark.parametrize("saved_width, loaded_width", [(1, 4), (4, 1)])
def test_a_buffer_of_another_shape_is_refused_before_anything_is_loaded(tmp_path, saved_width,
                                                                         loaded_width):
    # (1,) into (4,) used to broadcast silently; (4,) into (1,) failed after the parameters loaded.
    results = _save_then_load(tmp_path, _Scaled(saved_width), lambda: _Scaled(loaded_width, seed=9))
    for error, before, after in results:
        assert error is not None and "'scale'" in str(error) and f"{saved_width}" in str(error)
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0)


def test_a_missing_buffer_or_an_unexpected_parameter_is_named(tmp_path):
    class NoBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            with SEED_LOCK:
                torch.manual_seed(0)
                self.lin = nn.Linear(3, 2).double()

        def forward(self, x):
            return self.lin(x)
    for error, _, _ in _save_then_load(tmp_path, NoBuffer(), _Scaled):
        assert isinstance(error, checkpoint.CheckpointError) and "'scale'" in str(error)
    for error, _, _ in _save_then_load(tmp_path, _Scaled(extra=True), _Scaled):
        assert isinstance(error, checkpoint.CheckpointError) and "'extra.weight'" in str(error)


@pytest.mark.parametrize("freeze_when_saved", [False, True])
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_a_parameter_frozen_on_one_side_only_loads(tmp_path, strategy, freeze_when_saved):
    # Fine-tuning: a checkpoint that trained every parameter loads into a model whose first layer
    # is frozen (a frozen parameter is stored like a buffer), and the other way round.
    def make(frozen: bool, seed: int) -> nn.Module:
        model = _Scaled(extra=True, seed=seed)
        model.lin.requires_grad_(not frozen)
        return model
    results = _save_then_load(tmp_path, make(freeze_when_saved, 0),
                              lambda: make(not freeze_when_saved, 9), strategy=strategy)
    expected = make(False, 0).state_dict()
    for error, _, after in results:
        assert error is None, error
        for name, value in expected.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0)


def _mlp(first_frozen: bool) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    model[0].requires_grad_(not first_frozen)
    return model


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_optimizer_state_of_a_parameter_frozen_only_when_saved_starts_fresh(tmp_path, strategy):
    # Unfreezing a layer between runs: the checkpoint holds no optimizer state for it (a KeyError
    # on load). As torch's load_state_dict leaves it out, its state starts on its first step,
    # where its shards hold nothing else (DDP's parameters, ZeRO-3's modules); a shard that
    # also holds saved state keeps one Adam step count for both, so that is a ConfigError.
    path = tmp_path / "ckpt"
    spawn(lambda b: _train(b, strategy, [0, 1], save_to=path, build=lambda: _mlp(True)), 2, timeout=30)
    dense = _mlp(True)
    opt = torch.optim.Adam(dense.parameters(), lr=0.1)
    for step in range(4):
        dense[0].requires_grad_(step >= 2)
        _mse(dense(_batch(step, 0, 1)[0]), _batch(step, 0, 1)[1]).backward()
        opt.step()
        opt.zero_grad()

    def resume(b):
        return _train(b, strategy, [2, 3], load_from=path, build=lambda: _mlp(False))
    if strategy in ("zero1", "zero2", "fsdp"):
        with pytest.raises(ConfigError, match="'0.weight'|'0.bias'"):
            spawn(resume, 2, timeout=30)
        return
    for params in spawn(resume, 2, timeout=30):
        for name, value in dense.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


def _train_with(backend, optimizer_cls, steps, load_from=None, save_to=None, **settings):
    model = STRATEGIES["zero2"][0](_one_output_model(), backend)
    opt = STRATEGIES["zero2"][1](model, optimizer_cls, lr=0.1, **settings)
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    for step in steps:
        model.train_step(_batch(step, backend.rank, backend.world_size), _mse, opt)
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=len(steps))
    return model.gather_full_parameters()


@pytest.mark.parametrize("saved, loaded", [
    ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {})),  # failed in torch: KeyError 'step'
    ((torch.optim.Adam, {}), (torch.optim.SGD, {"momentum": 0.9})),  # Adam's moments dropped silently
])
def test_optimizer_state_of_another_optimizer_class_is_refused(tmp_path, saved, loaded):
    path = tmp_path / "ckpt"
    spawn(lambda b: _train_with(b, saved[0], [0, 1], save_to=path, **saved[1]), 2, timeout=30)
    with pytest.raises(ConfigError, match=f"optimizer state of {saved[0].__name__}, not of "
                                          f"{loaded[0].__name__}"):
        spawn(lambda b: _train_with(b, loaded[0], [2], load_from=path, **loaded[1]), 2, timeout=30)


def test_optimizer_state_loads_into_a_subclass_of_the_saved_class(tmp_path):
    # AdamW is a torch.optim.Adam: Adam's state (moments, step) is what it continues from.
    path = tmp_path / "ckpt"
    spawn(lambda b: _train_with(b, torch.optim.Adam, [0, 1], save_to=path), 2, timeout=30)
    resumed = spawn(lambda b: _train_with(b, torch.optim.AdamW, [2], load_from=path, weight_decay=0),
                    2, timeout=30)
    expected = spawn(lambda b: _train_with(b, torch.optim.Adam, [0, 1, 2]), 1, timeout=30)[0]
    for name, value in expected.items():
        torch.testing.assert_close(resumed[0][name], value, rtol=0, atol=1e-12)
