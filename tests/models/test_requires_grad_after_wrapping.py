"""A parameter frozen or unfrozen (``requires_grad_``) after its model was wrapped: each strategy
decides at construction which parameters it trains (DDP's buckets, ZeRO's and FSDP's flat
shards), so DDP and ZeRO-1/2 never trained an unfrozen one and kept stepping a frozen one (its
weight decay moved it), and ZeRO-3 failed with KeyError '0.weight', all without saying why. The
next forward with gradients on is now a ConfigError naming the parameter and the fix, on every
rank before any collective; a forward without gradients (evaluation) is not affected."""
import copy

import pytest
import torch
from torch import nn

from distframe import ConfigError, spawn
from tests.models.common import SEED_LOCK, STRATEGIES

with SEED_LOCK:
    torch.manual_seed(0)
    NET = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_requires_grad_changed_after_wrapping_is_refused_at_the_next_forward(strategy, change):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        net = copy.deepcopy(NET)
        net[0].weight.requires_grad_(change == "freeze")
        model = model_cls(net, backend)
        opt = opt_cls(model, torch.optim.AdamW, lr=0.1)
        model.wrapped_model[0].weight.requires_grad_(change == "unfreeze")
        with torch.no_grad():
            model(X)  # evaluation trains nothing: not refused
        with pytest.raises(ConfigError, match=r"'0\.weight'.*requires_grad.*before wrapping"):
            model.train_step((X, torch.zeros(4, 2, dtype=torch.float64)), nn.functional.mse_loss, opt)
        return True
    assert spawn(run, 2, timeout=20) == [True, True]
