"""AsyncSGDOptimizer with find_unused_parameters=True: a parameter that a worker's step did not
use gets no gradient on the server for that update, as in a plain sequential run (in-memory
engine; the rest of the async tests: test_async_sgd.py)."""
import copy

import torch
from torch import nn

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.optimizers.test_async_sgd import LR, _batch


class _Branchy(nn.Module):
    """``extra`` takes part only for batches of even size: unused in some steps."""

    def __init__(self):
        super().__init__()
        self.main, self.extra = nn.Linear(5, 2), nn.Linear(5, 2)

    def forward(self, x):
        return self.main(x) + (self.extra(x) if x.shape[0] % 2 == 0 else 0)


def _branchy_batch(worker, k):
    x, y = _batch(worker, k)
    return (x, y) if (worker + k) % 3 == 0 else (x[:5], y[:5])


def test_a_parameter_a_step_did_not_use_is_skipped_as_in_sequential_sgd():
    """find_unused_parameters=True and max_staleness=0: the server must leave the .grad of a
    parameter the step did not use None, as a plain run does, so AdamW neither decays it nor
    counts a step for it (it applied zeros: the unused branch decayed)."""
    torch.manual_seed(3)
    net, steps = _Branchy().double(), 4

    def fn(b):
        model = DDPModel(copy.deepcopy(net), b, find_unused_parameters=True)
        opt = AsyncSGDOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.5, max_staleness=0,
                                deterministic=True)
        if opt.is_server:
            opt.serve()
            return {k: v.detach().clone() for k, v in model.wrapped_model.state_dict().items()}
        for k in range(steps):
            opt.train_step(_branchy_batch(b.rank, k), nn.functional.mse_loss)
        opt.finish()
        return None
    params = spawn(fn, 3, timeout=30)[0]
    reference = copy.deepcopy(net)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.5)
    for k in range(steps):
        for w in (1, 2):
            x, y = _branchy_batch(w, k)
            opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            opt.step()
    assert max((params[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-12
