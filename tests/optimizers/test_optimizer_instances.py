"""What a user builds around a torch.optim instance before handing it to a sharded optimizer, and
optimizers and settings that failed without a useful word:
- an LR scheduler built on the instance (or lr set on it by hand) acted on a discarded copy;
- a tensor in the instance that is not the model's (a learned loss temperature) was never trained;
- frozen parameters stayed float32 beside bfloat16 trainable ones under a MixedPrecisionPolicy,
  so no input dtype worked;
- SparseAdam and torch.optim's hooks failed with torch's errors."""
import functools

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import (SEED_LOCK, SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice)

GAMMA = 0.5


def reference_with_step_lr(batches):
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_scheduler_built_on_the_instance_drives_the_sharded_optimizer(strategy):
    batches = global_batches(3, 4)

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        instance = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(instance, step_size=1, gamma=GAMMA)  # before wrapping
        opt = opt_cls(model, instance)
        for batch in batches:
            loss_fn(model(rank_slice(batch, backend.rank, 2)[0]), rank_slice(batch, backend.rank, 2)[1]).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        with pytest.raises(ConfigError, match=f"call that {opt_cls.__name__}'s step"):
            instance.step()   # it is the sharded optimizer's now: stepped alone it skips the syncs
        return model.gather_full_parameters(), opt.param_groups[0]["lr"], instance is opt.wrapped_optimizer

    expected = reference_with_step_lr(batches)
    for params, lr, same in spawn(run, 2):
        assert same
        assert lr == pytest.approx(0.1 * GAMMA ** 3)
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_tensor_outside_the_model_is_refused(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        temperature = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(ConfigError, match="1 tensor.*not parameters of the wrapped model"):
            opt_cls(model, torch.optim.SGD(list(model.parameters()) + [temperature], lr=0.1))
        with pytest.raises(ConfigError, match="not parameters of the wrapped model"):
            opt_cls(model, torch.optim.SGD([{"params": model.parameters()},
                                            {"params": [temperature], "lr": 0.5}], lr=0.1))
        return True

    assert all(spawn(run, 2))


def frozen_base(seed=0):
    with SEED_LOCK:  # in-memory ranks are threads sharing torch's generator
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)   # a frozen base layer, as under LoRA or fine-tuning
    return net


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_frozen_parameters_compute_in_param_dtype(strategy):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x = torch.randn(6, 4)
    reference = frozen_base().to(torch.bfloat16)
    expected = reference(x.to(torch.bfloat16))

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(frozen_base(), backend, mixed_precision=policy)
        opt = opt_cls(model, torch.optim.AdamW, lr=1e-3)
        out = model(x.to(torch.bfloat16))
        out.float().sum().backward()
        opt.step()
        return out.detach(), {p.dtype for p in model.wrapped_model[0].parameters()}

    for out, frozen_dtypes in spawn(run, 2):
        assert frozen_dtypes == {torch.bfloat16}
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_sparse_adam_and_hooks_get_config_errors():
    def run(backend):
        model_cls, opt_cls = STRATEGIES["ddp"]
        model = model_cls(nn.Sequential(nn.Embedding(10, 4, sparse=True)), backend)
        with pytest.raises(ConfigError, match="SparseAdam"):
            opt_cls(model, torch.optim.SparseAdam, lr=1e-2)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        messages = []
        for register in (opt.register_step_pre_hook, opt.register_step_post_hook,
                         opt.register_state_dict_pre_hook, opt.register_load_state_dict_post_hook):
            with pytest.raises(ConfigError, match="takes no torch.optim hooks") as info:
                register(lambda *args: None)
            messages.append(str(info.value))
        return messages

    for messages in spawn(run, 2):
        assert "before optimizer.step()" in messages[0]


def test_misuses_of_the_handed_over_instance_are_refused():
    from distframe import ShardedGradScaler

    def run(backend):
        model_cls, opt_cls = STRATEGIES["zero2"]
        model = model_cls(build_model(), backend, **SETTINGS["zero2"])
        hooked = torch.optim.SGD(model.parameters(), lr=0.1)
        hooked.register_step_post_hook(lambda *args: None)
        with pytest.raises(ConfigError, match="has hooks"):
            opt_cls(model, hooked)   # its hooks would have been dropped without a word
        instance = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = opt_cls(model, instance)
        with pytest.raises(ConfigError, match="already handed to a ZeRO2Optimizer"):
            opt_cls(model, instance)
        model(rank_slice(global_batches(1, 4)[0], backend.rank, 2)[0]).sum().backward()
        scaler = ShardedGradScaler("cpu", backend=backend)
        with pytest.raises(ConfigError, match="call that ZeRO2Optimizer's step"):
            scaler.step(instance)
        temperature = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        instance.add_param_group({"params": [temperature]})
        with pytest.raises(ConfigError, match="add_param_group"):
            opt.step()
        return True

    assert all(spawn(run, 2))


def _adopt_a_fresh_class(backend, cls):
    with SEED_LOCK:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()
    model = STRATEGIES["ddp"][0](net, backend)
    weights = [p for p in net.parameters() if p.dim() > 1]
    biases = [p for p in net.parameters() if p.dim() == 1]
    STRATEGIES["ddp"][1](model, cls([{"params": weights, "weight_decay": 0.1}, {"params": biases}], lr=0.05))


def test_threads_adopting_instances_of_a_class_at_once_do_not_collide():
    """Adopting an instance copies the rebuilt optimizer's attributes into it. Instances of one
    class share their attribute dicts' keys in CPython, and 8 in-memory ranks adopting the first
    instances of a class at once failed with "dict mutated during update" in about 1 run of 5.
    A fresh class each time recreates that first adoption."""
    for i in range(30):
        fresh = type(f"Adagrad{i}", (torch.optim.Adagrad,), {})
        spawn(functools.partial(_adopt_a_fresh_class, cls=fresh), 8)
