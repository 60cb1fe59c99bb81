"""Master weights under a MixedPrecisionPolicy start from the model's own values, not from the
low-precision compute copy: wrapping a float32 model (say, pretrained weights) for bfloat16
compute must not round its float32 masters to bfloat16."""
import pytest
import torch

from distframe import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import SETTINGS, STRATEGIES, build_model


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
