"""A module is wrapped once. A second wrapper over it (or over a module holding it) is a
ConfigError: ZeRO-3 and FSDP leave the parameters as views of storage freed between uses, and
the second wrapper's broadcast read it (a segmentation fault); DDP and ZeRO-1/2 leave gradient
hooks that would run alongside the new ones. A wrapper whose checks fail leaves the module
unmarked, so the fixed module can be wrapped."""
import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel, PipelineParallelModel
from tests.models.common import STRATEGIES, build_model


@pytest.mark.parametrize("second", list(STRATEGIES))
@pytest.mark.parametrize("first", list(STRATEGIES))
def test_a_wrapped_module_is_refused_by_a_second_wrapper(first, second):
    def run(backend):
        model = build_model()
        STRATEGIES[first][0](model, backend)
        with pytest.raises(ConfigError, match=f"{STRATEGIES[second][0].__name__} cannot wrap this module: it "
                                              f"was wrapped by {STRATEGIES[first][0].__name__} already"):
            STRATEGIES[second][0](model, backend)
        holder = nn.Sequential(model)
        with pytest.raises(ConfigError, match="its submodule '0' was wrapped"):
            DDPModel(holder, backend)
    spawn(run, 2)


def test_a_pipeline_stage_module_is_refused_by_a_second_wrapper():
    def run(backend):
        model = build_model()
        PipelineParallelModel(model, backend, num_microbatches=2)
        with pytest.raises(ConfigError, match="was wrapped by PipelineParallelModel already"):
            DDPModel(model, backend)
    spawn(run, 2)


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "fsdp"])
def test_a_module_refused_by_a_check_can_be_wrapped_once_fixed(strategy):
    def run(backend):
        model = build_model()
        model[0].float()  # two dtypes: refused
        with pytest.raises(ConfigError, match="dtype"):
            STRATEGIES[strategy][0](model, backend)
        model.double()
        wrapped = STRATEGIES[strategy][0](model, backend)
        return wrapped(torch.ones(2, 6, dtype=torch.float64)).shape
    assert spawn(run, 2) == [torch.Size([2, 3])] * 2
