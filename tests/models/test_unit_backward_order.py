"""ZeRO-3/FSDP gathers and reductions in backward pair up across ranks whatever tensors the units
return and however the loss reaches them: a unit returning its child unit's output itself on some
ranks only, activation checkpointing around a unit whose parameter some ranks leave unused. Each
case trains as one process (float64) on the in-memory engine, where an order that differs across
ranks is a CollectiveMismatchError (on Gloo and NCCL: a hang, or shards of another unit)."""
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES, build_model, global_batches, loss_fn, rank_slice
from tests.models.common import SETTINGS as COMMON_SETTINGS
from tests.models.test_unused_parameters import batches, micro_batches

TOL = 1e-10


class GatedChild(nn.Module):
    """Scales its child's output by ``gain`` on the rows whose gate is open: where no row is open
    (every row of the last rank's slices), it returns the child's output tensor itself."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(7, 7)
        self.gain = nn.Parameter(torch.full((7,), 1.5))

    def forward(self, h, mask):
        out = self.child(h)
        if bool(mask.any()):
            out = torch.where(mask[:, None], out * self.gain, out)
        return out


class Model(nn.Module):
    """``gated`` optionally under activation checkpointing (reentrant or not)."""

    def __init__(self, checkpointing=None):
        super().__init__()
        self.trunk = nn.Linear(5, 7)
        self.gated = GatedChild()
        self.head = nn.Linear(7, 3)
        self.checkpointing = checkpointing

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        mask = x[:, 0] > 0
        if self.checkpointing is None:
            out = self.gated(h, mask)
        else:
            out = checkpoint(self.gated, h, mask, use_reentrant=self.checkpointing == "reentrant")
        return self.head(out)


def make_model(checkpointing=None):
    with SEED_LOCK:
        torch.manual_seed(0)
        return Model(checkpointing).double()


# ZeRO-3: units trunk, gated (gain) around gated.child, head. FSDP: units trunk, gated.child
# and head inside the root unit (which holds gated.gain).
SETTINGS = {
    "zero3": {},
    "zero3-kept": {"reshard_after_forward": False},
    "fsdp": {"auto_wrap_policy": lambda module, name: name in ("trunk", "gated.child", "head")},
    "fsdp-kept": {"auto_wrap_policy": lambda module, name: name in ("trunk", "gated.child", "head"),
                  "reshard_after_forward": False},
}


def reference(data, checkpointing=None):
    model = make_model(checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train(backend, strategy, data, checkpointing=None):
    model_cls, optimizer_cls = STRATEGIES[strategy.split("-")[0]]
    model = model_cls(make_model(checkpointing), backend, **SETTINGS[strategy])
    opt = optimizer_cls(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    for x, y in data:
        piece = micro_batches(x, y, backend.world_size, 1, backend.rank)[0]
        model.train_step(piece, nn.functional.mse_loss, opt)
    return model.gather_full_parameters()


def assert_trains_as_one_process(world, strategy, checkpointing=None):
    data = batches(2, 12)
    expected = reference(data, checkpointing)
    results = spawn(functools.partial(train, strategy=strategy, data=data, checkpointing=checkpointing),
                    world, timeout=30)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", sorted(SETTINGS))
def test_a_unit_returning_its_childs_output_on_some_ranks_only(strategy, world):
    # On the closed ranks `gated` returns `gated.child`'s output itself: the hooks of both units
    # (and `head`'s input hook) sat on one tensor and ran in registration order, where the open
    # ranks ran them in the order autograd reaches two tensors; the gathers and reductions
    # no longer paired up (CollectiveMismatchError).
    assert_trains_as_one_process(world, strategy)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", sorted(SETTINGS))
def test_a_checkpointed_unit_with_a_parameter_some_ranks_leave_unused(strategy, world, checkpointing):
    # `gated.gain` gets no gradient on the closed ranks. Under reentrant checkpointing the
    # unit's forward ran without grad, so its backward ended when its parameters' gradients
    # were all accumulated: on the open ranks only, the others reduced it at the end.
    assert_trains_as_one_process(world, strategy, checkpointing)


def reductions_per_step(backend, strategy, leaf_input):
    """reduce_scatter calls and bytes of the second step, and the input's first gradient."""
    model_cls, optimizer_cls = STRATEGIES[strategy]
    model = model_cls(build_model(), backend, **COMMON_SETTINGS[strategy])
    opt = optimizer_cls(model, torch.optim.Adam, lr=1e-2)
    x, y = rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size)
    x = x.clone().requires_grad_(leaf_input)
    for step in range(2):
        backend.stats.reset()
        loss_fn(model(x), y).backward()
        stats = backend.stats.snapshot()
        opt.step()
        opt.zero_grad()
        if step == 0:
            first_grad, x.grad = x.grad, None
    return stats["calls"].get("reduce_scatter"), stats["bytes"].get("reduce_scatter"), first_grad


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_leaf_input_that_requires_grad_costs_no_second_reduction(strategy):
    # The input's gradient is accumulated as soon as its last user ran, before the rest of the
    # first unit's backward: the unit was reduced there, and again at the end for the gradients
    # that came after. One reduction per unit, as with an input that needs no gradient.
    plain = spawn(functools.partial(reductions_per_step, strategy=strategy, leaf_input=False), 2)
    leaf = spawn(functools.partial(reductions_per_step, strategy=strategy, leaf_input=True), 2)
    model = build_model()
    x, y = global_batches(1, 12)[0]
    x = x.clone().requires_grad_(True)
    loss_fn(model(x), y).backward()
    for rank, ((calls, nbytes, _), (leaf_calls, leaf_bytes, grad)) in enumerate(zip(plain, leaf)):
        assert (leaf_calls, leaf_bytes) == (calls, nbytes)
        # Each rank's mean loss over its half: its input's gradient is twice the global one's.
        torch.testing.assert_close(grad, 2 * rank_slice((x.grad, y), rank, 2)[0], rtol=0, atol=TOL)
