"""Bad pairings, bad settings and mismatched replicas are ConfigErrors that say the fix."""
import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel, MixedPrecisionPolicy, ShardingConfig, ZeRO2Model, ZeRO3Model
from distframe.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice)


def _one_rank(fn):
    return spawn(fn, 1)[0]


def test_optimizer_of_another_strategy_is_refused():
    def run(backend):
        model = DDPModel(build_model(), backend)
        with pytest.raises(ConfigError, match="ZeRO2Optimizer belongs with ZeRO2Model.*DDPOptimizer"):
            ZeRO2Optimizer(model, torch.optim.Adam)
        zero2 = ZeRO2Model(build_model(), backend)
        with pytest.raises(ConfigError, match="ZeRO1Optimizer belongs with ZeRO1Model"):
            ZeRO1Optimizer(zero2, torch.optim.Adam)
        plain = torch.optim.Adam(zero2.parameters())
        with pytest.raises(ConfigError, match=r"ZeRO2Optimizer\(model, torch.optim.Adam"):
            zero2.train_step(global_batches(1, 2)[0], loss_fn, plain)
        other = DDPOptimizer(DDPModel(build_model(), backend), torch.optim.SGD, lr=0.1)
        with pytest.raises(ConfigError, match="different model"):
            model.train_step(global_batches(1, 2)[0], loss_fn, other)
        with pytest.raises(ConfigError, match="either an optimizer instance or a class"):
            DDPOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), lr=0.2)
    _one_rank(run)


def test_plain_torch_optimizer_trains_ddp():
    def run(backend):
        model = DDPModel(build_model(), backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model.train_step(global_batches(1, 4)[0], loss_fn, opt)
    assert isinstance(_one_rank(run), float)


@pytest.mark.parametrize("settings, field", [
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
    ({"first_bucket_cap_mb": -1}, "first_bucket_cap_mb"),
    ({"auto_wrap_min_params": -5}, "auto_wrap_min_params"),
    ({"mixed_precision": torch.bfloat16}, "mixed_precision"),
    ({"reshard_after_forward": "yes"}, "reshard_after_forward"),
])
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        ShardingConfig(**settings)


def test_bad_settings_for_a_strategy():
    def run(backend):
        with pytest.raises(ConfigError, match="unknown setting"):
            DDPModel(build_model(), backend, bucket_size=3)
        with pytest.raises(ConfigError, match="mixed_precision applies to ZeRO and FSDP"):
            DDPModel(build_model(), backend, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        with pytest.raises(ConfigError, match="auto_wrap_policy applies to FSDPModel"):
            ZeRO3Model(build_model(), backend, auto_wrap_policy=lambda m, n: True)
        with pytest.raises(ConfigError, match="not a floating dtype"):
            MixedPrecisionPolicy(param_dtype=torch.int8)
        mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
        with pytest.raises(ConfigError, match="'1.weight' is torch.float64"):
            ZeRO2Model(mixed, backend)
    _one_rank(run)


def test_different_models_on_different_ranks_name_the_parameter_and_ranks():
    def run(backend):
        width = 5 if backend.rank == 2 else 4
        DDPModel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, width)), backend)
    with pytest.raises(ConfigError, match=r"1.weight \(4, 4\).*1.weight \(5, 4\).*rank\(s\) \[2\]"):
        spawn(run, 3)


@pytest.mark.parametrize("optimizer_cls, settings", [
    (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.3}),   # its defaults hold a setting its
    (torch.optim.Adagrad, {"lr": 0.05}),                      # constructor refuses; state at init
    (torch.optim.Adam, {"lr": 0.02, "betas": (0.8, 0.9)}),
])
def test_an_optimizer_instance_trains_as_its_class_with_the_same_settings(optimizer_cls, settings):
    def run(backend):
        results = []
        for instance in (True, False):
            model = ZeRO2Model(build_model(), backend)
            opt = (ZeRO2Optimizer(model, optimizer_cls(model.parameters(), **settings)) if instance
                   else ZeRO2Optimizer(model, optimizer_cls, **settings))
            for batch in global_batches(2, 4):
                model.train_step(batch, loss_fn, opt)
            results.append(model.gather_full_parameters())
        return results
    from_instance, from_class = _one_rank(run)
    for name, value in from_class.items():
        torch.testing.assert_close(from_instance[name], value, rtol=0, atol=0)


def test_an_optimizer_instance_with_groups_of_one_setting_or_with_steps():
    # Groups of different settings are kept: test_param_groups.py.
    def run(backend):
        model = ZeRO2Model(build_model(), backend)
        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        same = torch.optim.SGD([{"params": decay}, {"params": no_decay}], lr=0.01)
        assert ZeRO2Optimizer(model, same).param_groups[0]["lr"] == 0.01
        weight = nn.Parameter(torch.ones(2))
        weight.grad = torch.ones(2)
        stepped = torch.optim.SGD([weight], lr=0.01, momentum=0.9)
        stepped.step()
        with pytest.raises(ConfigError, match="already taken steps"):
            ZeRO2Optimizer(model, stepped)
    _one_rank(run)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Muon])
def test_optimizers_that_read_whole_parameters_are_refused_over_flat_chunks(strategy, optimizer_cls):
    # Adafactor over ZeRO/FSDP chunks trained 2e-2 away from one process after 4 steps, silently;
    # Muon failed with its own "only supports 2D parameters" for a model of 2-D weights.
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        with pytest.raises(ConfigError, match=f"{optimizer_cls.__name__}.*element-wise optimizer"):
            opt_cls(model, optimizer_cls, lr=0.01)
        with pytest.raises(ConfigError, match=f"{optimizer_cls.__name__}.*element-wise optimizer"):
            opt_cls(model, optimizer_cls([p for p in model.parameters() if p.dim() == 2], lr=0.01))
    spawn(run, 2)


def test_ddp_optimizer_sees_whole_parameters_so_adafactor_trains_as_one_process():
    def run(backend):
        model = DDPModel(build_model(), backend)
        opt = DDPOptimizer(model, torch.optim.Adafactor, lr=0.01)
        for batch in global_batches(3, 4):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()
    reference = build_model()
    opt = torch.optim.Adafactor(reference.parameters(), lr=0.01)
    for x, y in global_batches(3, 4):
        loss_fn(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    for params in spawn(run, 2):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_optimizer_instance_over_some_parameters_is_refused(strategy):
    # Rebuilt over the local shards, an instance built to train only the head trained every
    # parameter, silently (fine-tuning the head moved the whole model).
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        head_only = torch.optim.SGD(model.module[3].parameters(), lr=0.1)
        with pytest.raises(ConfigError, match=r"leaves out 10 trainable parameter\(s\).*'0.weight'.*freeze"):
            opt_cls(model, head_only)
        opt_cls(model, torch.optim.SGD(model.local_parameter_shard(), lr=0.1))  # the shards: fine
        frozen = build_model()
        for p in frozen[:3].parameters():
            p.requires_grad_(False)
        model = model_cls(frozen, backend, **SETTINGS[strategy])
        opt_cls(model, torch.optim.SGD(model.module[3].parameters(), lr=0.1))  # the rest frozen: fine
    spawn(run, 2)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_a_torch_optimizer_state_dict_is_a_config_error(strategy):
    # It failed with "KeyError: 'tensors'".
    reference = build_model()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    loss_fn(reference(global_batches(1, 4)[0][0]), global_batches(1, 4)[0][1]).backward()
    plain.step()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        opt = opt_cls(model_cls(build_model(), backend, **SETTINGS[strategy]), torch.optim.Adam, lr=0.01)
        expected = r"merged .*got \['param_groups', 'state'\].*torch.optim state dict"
        with pytest.raises(ConfigError, match=expected):
            opt.load_state_dict(plain.state_dict())
    spawn(run, 2)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
@pytest.mark.parametrize("table", [nn.Embedding, nn.EmbeddingBag])
def test_sparse_gradients_are_refused_by_the_flat_sharded_strategies(strategy, table):
    # Their units reduce-scatter one flat dense gradient; a sparse one crashed in backward with
    # torch's "reshape is not implemented for sparse tensors".
    def run(backend):
        model = nn.Sequential(nn.Linear(4, 4))
        model.add_module("table", table(10, 4, sparse=True))
        with pytest.raises(ConfigError, match=r"'table' \(.*\) has sparse=True.*sparse=False.*DDPModel"):
            STRATEGIES[strategy][0](model, backend)
        model.table.weight.requires_grad_(False)  # frozen: it makes no gradient, nothing to refuse
        STRATEGIES[strategy][0](model, backend)
    _one_rank(run)
