"""Parameters that get no gradient under ZeRO-3 and FSDP: their flat shards cannot skip one (so
``find_unused_parameters`` is refused), and such a parameter is averaged as zeros, which weight
decay and momentum then move where one process would not. Each rank that sees one at a
synchronisation warns once, naming it, as DDP, ZeRO-1 and ZeRO-2 do."""
import contextlib
import functools
import warnings

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES
from tests.models.test_unused_parameters import batches, micro_batches

class GatedHead(nn.Module):
    """``extra`` is used on the rows whose first feature is positive (none of rank 1's). ZeRO-3
    and FSDP need every rank to run the same modules (their gathers are collectives), so the
    gate is inside one module, which runs on every rank."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(7, 3)
        self.extra = nn.Parameter(torch.randn(3, 7) / 3)

    def forward(self, h, mask):
        out = self.head(h)
        if bool(mask.any()):
            out = out.index_add(0, mask.nonzero()[:, 0], h[mask] @ self.extra.T)
        # Not `head`'s output itself on some ranks: a unit's output hooks would then run in
        # another order there than where `out` is a new tensor (the inner unit's first).
        return torch.tanh(out)


class Gated(nn.Module):
    """``spare`` runs only when asked (on no rank in some steps)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 7)
        self.gated = GatedHead()
        self.spare = nn.Linear(7, 3)

    def forward(self, x, use_spare=False):
        h = torch.tanh(self.trunk(x))
        out = self.gated(h, x[:, 0] > 0)
        return out + self.spare(h) if use_spare else out


def make_model():
    with SEED_LOCK:
        torch.manual_seed(0)
        return Gated().double()


# FSDP units: one per Linear (the unused ones alone in theirs), or everything in the root unit.
SHARDED = {"zero3": {}, "fsdp-per-layer": {"auto_wrap_min_params": 1}, "fsdp-root": {}}


def run(backend, strategy, data, spare_steps, micro=1, open_gate=False):
    """Trains ``Gated`` with AdamW; ``spare`` runs in the micro-batches ``spare_steps`` names
    ((step, k) pairs); ``open_gate`` opens the gate on every row of every rank."""
    model_cls, optimizer_cls = STRATEGIES[strategy.split("-")[0]]
    model = model_cls(make_model(), backend, **SHARDED[strategy])
    opt = optimizer_cls(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        if open_gate:
            x = x.clone()
            x[:, 0] = x[:, 0].abs()
        pieces = micro_batches(x, y, backend.world_size, micro, backend.rank)
        for k, (xm, ym) in enumerate(pieces):
            with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
                out = model(xm, use_spare=(step, k) in spare_steps)
                (nn.functional.mse_loss(out, ym) / micro).backward()
        opt.step()
        opt.zero_grad()


def warnings_of(fn, world=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spawn(fn, world)
    return [str(w.message) for w in caught if "got no gradient" in str(w.message)]


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_each_rank_warns_once_naming_the_parameters(strategy):
    # No rank runs `spare` in steps 0 and 2.
    messages = warnings_of(functools.partial(run, strategy=strategy, data=batches(3, 12),
                                             spare_steps={(1, 0)}, open_gate=True))
    assert len(messages) == 2, messages
    owner = "ZeRO3Model" if strategy == "zero3" else "FSDPModel"
    assert all(m.startswith(f"{owner}: 2 parameter(s) got no gradient") for m in messages), messages
    assert all("('spare.weight', 'spare.bias')" in m for m in messages), messages
    assert {m.split(" on rank ")[1][0] for m in messages} == {"0", "1"}, messages
    assert all("DDPModel with find_unused_parameters=True" in m for m in messages), messages


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_a_parameter_unused_only_after_zero_grad_is_seen(strategy):
    # `spare` runs in step 0 only: zero_grad clears its gradient, so step 1 must see it unused.
    messages = warnings_of(functools.partial(run, strategy=strategy, data=batches(2, 12),
                                             spare_steps={(0, 0)}, open_gate=True))
    assert len(messages) == 2 and all("'spare.weight'" in m for m in messages), messages


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_no_warning_when_every_parameter_gets_a_gradient(strategy):
    # `spare` runs in the first (no_sync) micro-batch of each step only: that gradient counts.
    spare_steps = {(step, 0) for step in range(2)}
    messages = warnings_of(functools.partial(run, strategy=strategy, data=batches(2, 12),
                                             spare_steps=spare_steps, micro=2, open_gate=True), world=3)
    assert messages == []


def reference_without_spare(data):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: t for n, t in model.state_dict().items() if not n.startswith("spare.")}


def assert_matches_without_spare(results, data):
    expected = reference_without_spare(data)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)


def train_gated(backend, strategy, data):
    """AdamW steps of ``Gated`` (``spare`` unused) on this rank's slices; the full parameters."""
    model_cls, optimizer_cls = STRATEGIES[strategy.split("-")[0]]
    model = model_cls(make_model(), backend, **SHARDED[strategy])
    opt = optimizer_cls(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    for x, y in data:
        piece = micro_batches(x, y, backend.world_size, 1, backend.rank)[0]
        nn.functional.mse_loss(model(piece[0]), piece[1]).backward()
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_a_parameter_some_ranks_leave_unused_trains_as_one_process(strategy, world):
    # `gated.extra` gets a gradient from the rows whose gate is open: all of rank 0's, none of
    # the last rank's. Its unit's backward then completed on some ranks only, and each rank
    # reduced it at another point among the other units' gathers (CollectiveMismatchError on
    # the in-memory engine). Averaged with the closed ranks' zeros, its gradient is the global
    # batch's, so every parameter `spare` aside (which no rank uses) matches one process.
    data = batches(3, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = spawn(functools.partial(train_gated, strategy=strategy, data=data), world)
    assert_matches_without_spare(results, data)
    closed = [str(w.message) for w in caught if f"on rank {world - 1} " in str(w.message)]
    assert len(closed) == 1 and "'gated.extra'" in closed[0], closed


class InPlaceStart(nn.Module):
    """A unit whose forward modifies its input in place (nn.ReLU(inplace=True) first)."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(3))  # so that ZeRO-3 makes a unit of this module too

    def forward(self, h):
        return self.fc(self.act(h)) * self.scale


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_a_unit_that_modifies_its_input_in_place_trains_as_one_process(strategy):
    # Ending a unit's backward at its inputs must leave them ordinary tensors: an identity
    # autograd Function in front of the unit made them views that autograd refuses to modify.
    def build():
        with SEED_LOCK:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(5, 7), InPlaceStart()).double()

    data = batches(2, 12)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = model.state_dict()

    def train(backend):
        model_cls, optimizer_cls = STRATEGIES[strategy.split("-")[0]]
        model = model_cls(build(), backend, **SHARDED[strategy])
        opt = optimizer_cls(model, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
        for x, y in data:
            piece = micro_batches(x, y, backend.world_size, 1, backend.rank)[0]
            model.train_step(piece, nn.functional.mse_loss, opt)
        return model.gather_full_parameters()

    for params in spawn(train, 2):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
