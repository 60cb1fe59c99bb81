"""Pipeline stages hold different parameters, so their optimizers' param groups differ (layer-wise
learning rates): a checkpoint keeps every stage's groups, and each stage resumes with its own
settings (a scheduler's initial_lr included), so a resumed run is the uninterrupted one."""
import json

import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.pipeline import PipelineParallelModel
from distframe.optimizers import ZeRO1Optimizer
from tests.models.common import SEED_LOCK

DECAY = 0.9  # the scheduler's factor per step
WORLD = {"pipeline": 2, "hybrid": 4}


def _build(kind, backend, seed):
    with SEED_LOCK:
        torch.manual_seed(seed)
        module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]).double()
    if kind == "pipeline":
        model = PipelineParallelModel(module, backend, num_microbatches=2)
    else:
        model = HybridShardedModel(module, backend, dims=ParallelDims(dp=2, pp=2), num_microbatches=2,
                                   data_parallel="zero1")
    by_layer = {}
    for name, param in model.dense_named_parameters():
        by_layer.setdefault(int(name.split(".")[0]), []).append(param)
    # Layer-wise learning rates: one group per layer this stage holds.
    opt = torch.optim.AdamW([{"params": ps, "lr": 0.1 * 0.5 ** i} for i, ps in sorted(by_layer.items())])
    return model, opt if kind == "pipeline" else ZeRO1Optimizer(model, opt)


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(steps)]


def _train(model, opt, scheduler, batches):
    for x in batches:
        model.train_step((x, x), nn.functional.mse_loss, opt)
        scheduler.step()


def _settings(opt):
    return [value for g in opt.param_groups for value in (g["lr"], g["initial_lr"])]


@pytest.mark.parametrize("kind", ["pipeline", "hybrid"])
def test_every_stage_resumes_with_its_own_param_groups(tmp_path, kind):
    # Every stage took rank 0's (stage 0's) learning rates: the resumed run's later layers
    # moved by 0.075 from the uninterrupted run's.
    batches = _batches(3)

    def straight(backend):
        model, opt = _build(kind, backend, 0)
        _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: DECAY ** s), batches)
        return model.gather_full_parameters(), _settings(opt)

    def first(backend):
        model, opt = _build(kind, backend, 0)
        _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: DECAY ** s), batches[:1])
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)

    def resumed(backend):
        model, opt = _build(kind, backend, 3)
        for group in opt.param_groups:  # other settings, so that only the load sets them right
            group["lr"] = 0.7
        step = checkpoint.load(tmp_path / "ckpt", model, opt)["step"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: DECAY ** s, last_epoch=step - 1)
        _train(model, opt, scheduler, batches[1:])
        return model.gather_full_parameters(), _settings(opt)

    expected = spawn(straight, WORLD[kind], timeout=60)
    spawn(first, WORLD[kind], timeout=60)
    got = spawn(resumed, WORLD[kind], timeout=60)
    for rank, ((_, want_settings), (_, settings)) in enumerate(zip(expected, got)):
        assert settings == pytest.approx(want_settings, rel=1e-12, abs=0), rank
    for (want_params, _), (params, _) in zip(expected, got):
        for name, value in params.items():
            torch.testing.assert_close(value, want_params[name], rtol=0, atol=1e-12)
    # The later stage's groups really are the later layers' (not stage 0's) settings.
    assert expected[-1][1][1::2] == [0.025, 0.0125]
    # Every stage's groups are in the metadata, once each (not once per data-parallel replica).
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert [g["initial_lr"] for g in meta["optimizer"]["param_groups"]] == [0.1, 0.05, 0.025, 0.0125]


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_shards_of_one_group_are_one_entry_naming_every_parameter(tmp_path, strategy):
    """ZeRO's and FSDP's ranks each train the parameters of their own shard: their groups are one
    group of the metadata, not one per rank, and it names every parameter."""
    from distframe.models import FSDPModel, ZeRO2Model
    from distframe.optimizers import FSDPOptimizer, ZeRO2Optimizer
    model_cls, opt_cls = {"zero2": (ZeRO2Model, ZeRO2Optimizer), "fsdp": (FSDPModel, FSDPOptimizer)}[strategy]

    def run(backend):
        with SEED_LOCK:
            torch.manual_seed(0)
            module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()
        model = model_cls(module, backend)
        opt = opt_cls(model, torch.optim.AdamW, lr=0.1)
        x = _batches(1)[0]
        model.train_step((x, x[:, :2]), nn.functional.mse_loss, opt)
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)

    spawn(run, 3, timeout=60)
    groups = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["optimizer"]["param_groups"]
    assert len(groups) == 1, groups
    assert groups[0]["parameters_trained"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
