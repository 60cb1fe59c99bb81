"""load_state_dict takes the unwrapped model's plain state dict (what gather_full_parameters() and
checkpoint.consolidate return, and what torch users load pretrained weights from)."""
import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice


def _variant(kind: str, seed: int):
    model = build_model(seed=seed)
    if kind == "tied":
        model[2].fc.weight = model[1].fc.weight
    if kind == "frozen":
        for p in model[1].parameters():
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("kind", ["plain", "tied", "frozen"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_plain_state_dict_loads_and_trains_as_one_process(strategy, kind):
    pretrained = _variant(kind, seed=3).state_dict()
    batches = global_batches(2, 12)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(_variant(kind, seed=0), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        model.load_state_dict(pretrained)
        loaded = model.gather_full_parameters()
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return loaded, model.gather_full_parameters()

    reference = _variant(kind, seed=0)
    reference.load_state_dict(pretrained)
    opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for x, y in batches:
        loss_fn(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    for loaded, trained in spawn(run, 2):
        for name, value in pretrained.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_a_plain_state_dict_of_another_model_is_a_config_error(strategy):
    # It failed with "ValueError: not enough values to unpack (expected 2, got 1)".
    full = build_model(seed=3).state_dict()

    def run(backend):
        model = STRATEGIES[strategy][0](build_model(), backend, **SETTINGS[strategy])
        missing_and_unexpected = r"lacks parameter\(s\) \['0.weight'.*unexpected.*'module.0.weight'"
        with pytest.raises(ConfigError, match=missing_and_unexpected):
            model.load_state_dict({f"module.{k}": v for k, v in full.items()})
        wider = dict(full, **{"0.weight": torch.zeros(18, 6, dtype=torch.float64)})
        with pytest.raises(ConfigError, match=r"'0.weight' has shape \[17, 6\] here but \[18, 6\]"):
            model.load_state_dict(wider)
        with pytest.raises(ConfigError, match="lacks parameter"):
            model.load_state_dict({k: v for k, v in full.items() if k != "3.bias"})
        model.load_state_dict(dict(full, extra=torch.zeros(1)), strict=False)
        return model.gather_full_parameters()["3.bias"]
    for bias in spawn(run, 2):
        torch.testing.assert_close(bias, full["3.bias"], rtol=0, atol=0)
