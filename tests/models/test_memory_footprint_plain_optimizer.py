"""memory_footprint() of a model trained by a plain torch.optim optimizer (DDPModel takes one, as
torch DDP does) counted no optimizer state: only a ShardedOptimizer told the model about itself."""
import torch

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers import DDPOptimizer
from tests.models.common import build_model, global_batches, loss_fn, rank_slice


def test_plain_optimizer_state_is_counted_as_a_ddp_optimizers_is():
    def run(backend):
        x, y = rank_slice(global_batches(1, 8)[0], backend.rank, 2)
        footprints = []
        for wrap in (False, True):
            model = DDPModel(build_model(), backend)
            opt = (DDPOptimizer(model, torch.optim.Adam, lr=1e-3) if wrap
                   else torch.optim.Adam(model.parameters(), lr=1e-3))
            loss_fn(model(x), y).backward()  # a plain loop: the model never sees the optimizer
            opt.step()
            footprints.append(model.memory_footprint()["optimizer_state"])
        return footprints
    adam = 2 * sum(p.numel() * p.element_size() for p in build_model().parameters())
    for plain, wrapped in spawn(run, 2):
        assert plain == wrapped >= adam
