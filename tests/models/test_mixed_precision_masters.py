"""Master weights under a MixedPrecisionPolicy start from the model's own values, not from the
low-precision compute copy: wrapping a float32 model (say, pretrained weights) for bfloat16
compute must not round its float32 masters to bfloat16."""
import pytest
import torch

from distframe import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import SETTINGS, STRATEGIES, build_model, tiny_lm


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_masters_hold_the_models_full_precision_values(strategy, param_dtype):
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)

    def run(backend):
        model_cls, _ = STRATEGIES[strategy]
        model = model_cls(build_model(torch.float32), backend, mixed_precision=policy,
                          **SETTINGS[strategy])
        assert all(s.dtype == torch.float32 for s in model.local_parameter_shard())
        return model.gather_full_parameters()
    initial = build_model(torch.float32).state_dict()
    for params in spawn(run, 2):
        for name, value in initial.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_every_name_of_a_tied_weight_gets_the_master(strategy):
    # ZeRO-1/2 gathered a shared weight under its first name only; its second name (the LM's
    # head, tied to the embedding) came from the wrapped model, the bfloat16 compute copy, and
    # loading the dict into a plain model (the usual export) kept the rounded values.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

    def run(backend):
        model_cls, _ = STRATEGIES[strategy]
        return model_cls(tiny_lm().float(), backend, mixed_precision=policy).gather_full_parameters()
    initial = tiny_lm().float().state_dict()
    assert torch.equal(initial["head.weight"], initial["tok_embedding.weight"])
    for params in spawn(run, 2):
        assert params.keys() == initial.keys()
        for name, value in initial.items():
            assert params[name].dtype == value.dtype, name
            torch.testing.assert_close(params[name], value, rtol=0, atol=0)
