"""AsyncSGDOptimizer's checkpoints name the parameters each param group trained, as the other
sharded optimizers' do: loaded into an optimizer whose groups are built in another order, each
group gets its own settings (they went by position: the biases took the weights' lr and decay)."""
import torch

from distframe import checkpoint
from distframe.launch import spawn
from distframe.models import DDPModel
from distframe.optimizers import DDPOptimizer
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.models.common import build_model, global_batches, loss_fn

WEIGHTS, BIASES = {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.0}


def grouped(model, reverse=False):
    named = list(model.wrapped_model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() >= 2], **WEIGHTS},
              {"params": [p for _, p in named if p.dim() < 2], **BIASES}]
    return torch.optim.SGD(groups[::-1] if reverse else groups, lr=0.05, momentum=0.9)


def test_groups_built_in_another_order_get_their_own_settings(tmp_path):
    def save(backend):
        model = DDPModel(build_model(), backend)
        opt = AsyncSGDOptimizer(model, grouped(model), max_staleness=1, deterministic=True)
        if opt.is_server:
            opt.serve()
        else:
            for x, y in global_batches(2, 4, seed=backend.rank):
                opt.train_step((x, y), loss_fn)
            opt.finish()
        opt.synchronize_parameters()
        checkpoint.save(tmp_path / "ckpt", model, opt, step=2)

    def load(backend):
        model = DDPModel(build_model(), backend)
        opt = DDPOptimizer(model, grouped(model, reverse=True))
        checkpoint.load(tmp_path / "ckpt", model, opt)
        return [(len(g["params"][0].shape), g["lr"], g["weight_decay"]) for g in opt.param_groups]

    spawn(save, 3)
    for groups in spawn(load, 2):
        assert groups == [(1, BIASES["lr"], BIASES["weight_decay"]), (2, WEIGHTS["lr"], WEIGHTS["weight_decay"])]
