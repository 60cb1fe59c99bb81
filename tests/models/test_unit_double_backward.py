"""ZeRO-3/FSDP and a backward with create_graph=True (a gradient penalty): a ConfigError naming
the cause, on every rank, instead of torch's 'setStorage ... storage of size 0' from the second
backward reading freed parameters."""
import pytest
import torch
from torch import nn

from distframe import ConfigError, spawn
from distframe.models import FSDPModel, ZeRO3Model
from tests.models.common import SEED_LOCK


def penalty_step(backend, model_cls):
    with SEED_LOCK:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    model = model_cls(net, backend)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = model(x).pow(2).sum()
    try:
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad.pow(2).sum()).backward()
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("model_cls", [ZeRO3Model, FSDPModel], ids=lambda c: c.__name__)
def test_a_gradient_penalty_is_refused_with_a_config_error_on_every_rank(model_cls):
    for message in spawn(lambda b: penalty_step(b, model_cls), 2, timeout=20):
        assert message is not None and "create_graph=True" in message and "DDPModel" in message
