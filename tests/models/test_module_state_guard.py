"""The wrapped module's own state dict under ZeRO-3/FSDP, and the stand-ins it holds between uses.

- ``torch.save(model.module.state_dict())`` (torch DDP's idiom) saved NaN for every resharded
  parameter without a word; it is now a ConfigError naming the ways that work, and inside
  ``summon_full_parameters()`` it returns the whole weights. ``model.module.load_state_dict``
  failed with torch's internal-overlap error; it is a ConfigError, and inside the block it loads.
- ``nn.init.zeros_`` on a resharded parameter wrote into one NaN shared by every resharded
  parameter of the process, so an unrelated model's parameters read 0 where NaN marks them.
See [Note: the wrapped module's own state dict] in distframe/models/module_state_guard.py.
"""
import copy

import pytest
import torch
from torch import nn

from distframe import ConfigError, spawn
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice

SHARDED = ["zero3", "fsdp"]
SETTINGS = {"zero3": {}, "fsdp": {"auto_wrap_min_params": 100}}


@pytest.mark.parametrize("strategy", SHARDED)
def test_the_module_state_dict_is_refused_between_uses_and_whole_when_summoned(strategy):
    loaded = build_model(seed=7).state_dict()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        model.train_step(rank_slice(global_batches(1, 4)[0], backend.rank, 2), loss_fn, opt)
        with pytest.raises(ConfigError, match=r"model\.module\.state_dict\(\) would hold NaN for '0\.weight'"):
            model.module.state_dict()
        with pytest.raises(ConfigError, match=r"model\.module\.load_state_dict\(\) cannot write"):
            model.module.load_state_dict(loaded)
        full = model.gather_full_parameters()
        with model.summon_full_parameters():
            inside = {k: v.clone() for k, v in model.module.state_dict().items()}
            model.module.load_state_dict(loaded)
        return full, inside, model.gather_full_parameters()

    for full, inside, after in spawn(run, 2, timeout=20):
        assert inside.keys() == full.keys()
        for name, value in full.items():
            torch.testing.assert_close(inside[name], value, rtol=0, atol=0)
            torch.testing.assert_close(after[name], loaded[name], rtol=0, atol=0)


def test_the_data_parallel_module_state_dict_stays_the_weights():
    def run(backend):
        model = STRATEGIES["zero2"][0](build_model(), backend)
        return model.module.state_dict(), model.gather_full_parameters()

    for own, full in spawn(run, 2, timeout=20):
        for name, value in full.items():
            torch.testing.assert_close(own[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", SHARDED)
def test_an_edit_of_one_models_stand_in_reaches_no_other_model(strategy):
    def run(backend):
        model_cls = STRATEGIES[strategy][0]
        edited = model_cls(build_model(), backend, **SETTINGS[strategy])
        with torch.no_grad():
            nn.init.zeros_(edited.module[0].bias)  # one value written: torch sees no overlap
        fresh = model_cls(build_model(), backend, **SETTINGS[strategy])
        return fresh.module[3].weight.detach().flatten()[:3].clone()

    for values in spawn(run, 2, timeout=20):
        assert torch.isnan(values).all(), values


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_deep_copy_of_the_module_is_refused_with_the_way_to_keep_one(strategy):
    def run(backend):
        model = STRATEGIES[strategy][0](build_model(), backend, **SETTINGS[strategy])
        with pytest.raises(ConfigError, match=r"copy\.deepcopy\(model\.module\) would copy NaN.*"
                                              r"ema\.load_state_dict\(model\.gather_full_parameters\(\)\)"):
            copy.deepcopy(model.module)
        ema = build_model()
        ema.load_state_dict(model.gather_full_parameters())  # the way the error gives
        return ema.state_dict()

    want = build_model().state_dict()
    for got in spawn(run, 2, timeout=20):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)
