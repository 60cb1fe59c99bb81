"""In-place edits of parameters after wrapping (``model.module.apply(init_fn)``, ``p.clamp_()``
between steps) written into the master weights the optimizer steps, from a third review: they were
lost under ZeRO-1/2 with mixed precision and in ZeRO-3/FSDP units kept gathered
(distframe/models/master_weights.py).

Exactness: the references redo each rank's float32 (or float64) forward and backward on its own
rows, average the two gradients in that dtype as the reduce_scatter does, and update float64
masters: the only rounding that may differ is SGD's float64 update, hence 1e-10."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import SEED_LOCK
from tests.models.test_mixed_precision_review3 import F32, LR, WORLD, batches, loss64, net, rows, wrap

def init_fn(module):
    if isinstance(module, nn.Linear):
        g = torch.Generator().manual_seed(module.in_features * 10 + module.out_features)
        with torch.no_grad():
            nn.init.normal_(module.weight, 0, 0.5, generator=g)
            nn.init.constant_(module.bias, 0.05)


def clamp(module):
    with torch.no_grad():
        for p in module.parameters():
            p.clamp_(-0.3, 0.3)


def edited_reference(compute_dtype: torch.dtype, steps: int = 3) -> dict[str, torch.Tensor]:
    """Float64 masters, a compute copy in ``compute_dtype``; an in-place edit of the compute copy
    gives each master the edited value where it changed the element (elsewhere the master keeps
    its precision). Each rank's gradient on its rows, averaged in ``compute_dtype``; SGD."""
    masters = {n: p.detach().clone() for n, p in net().named_parameters()}
    compute = net().to(compute_dtype)

    def edit(fn):
        load_compute()
        before = {n: p.detach().clone() for n, p in compute.named_parameters()}
        fn(compute)
        for n, p in compute.named_parameters():
            changed = p.detach() != before[n]
            masters[n] = torch.where(changed, p.detach().double(), masters[n])

    def load_compute():
        with torch.no_grad():
            for n, p in compute.named_parameters():
                p.copy_(masters[n])

    edit(lambda m: m.apply(init_fn))
    for batch in batches(steps):
        load_compute()
        grads = []
        for rank in range(WORLD):
            compute.zero_grad()
            x, y = rows(batch, rank)
            loss64(compute(x.to(compute_dtype)), y).backward()
            grads.append({n: p.grad.clone() for n, p in compute.named_parameters()})
        for n in masters:
            masters[n] = masters[n].add((grads[0][n] + grads[1][n]).div(WORLD).double(), alpha=-LR)
        edit(clamp)
    return masters


EDITED = [("zero1", {}), ("zero1", {"mixed_precision": F32}), ("zero2", {"mixed_precision": F32}),
          ("zero3", {"replicate_below_numel": 1000}), ("fsdp", {"replicate_below_numel": 1000}),
          ("zero3", {"replicate_below_numel": 1000, "mixed_precision": F32}),
          ("fsdp", {"replicate_below_numel": 1000, "mixed_precision": F32})]


@pytest.mark.parametrize("strategy, extra", EDITED,
                         ids=[f"{s}-{'-'.join(e) or 'plain'}" for s, e in EDITED])
def test_in_place_edits_after_wrapping_and_between_steps_are_trained(strategy, extra):
    # model.module.apply(init_fn) after wrapping, and a clamp_ after each step (a WGAN critic):
    # the forward used the edit, the optimizer stepped the old masters, then the edit was lost.
    compute_dtype = torch.float32 if "mixed_precision" in extra else torch.float64

    def run(backend):
        model, opt = wrap(strategy, net(), backend, **extra)
        model.module.apply(init_fn)
        for batch in batches():
            x, y = rows(batch, backend.rank)
            model.train_step((x.to(compute_dtype), y), loss64, opt)
            clamp(model.module)
        return model.gather_full_parameters()
    expected = edited_reference(compute_dtype)
    for got in spawn(run, WORLD, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy, extra", [("zero2", {"mixed_precision": F32}),
                                             ("fsdp", {"replicate_below_numel": 1000})])
def test_an_edit_is_seen_by_gather_and_summon_before_any_forward(strategy, extra):
    def run(backend):
        model, _ = wrap(strategy, net(), backend, **extra)
        before = model.module.b.weight.detach().double().clone()
        with torch.no_grad():
            model.module.b.weight.mul_(0.5)
        gathered = model.gather_full_parameters()["b.weight"]
        with model.summon_full_parameters(writeback=False):
            summoned = model.module.b.weight.detach().clone()
        return before, gathered, summoned
    for before, gathered, summoned in spawn(run, WORLD, timeout=60):
        halved = (before * 0.5).to(gathered.dtype)
        assert torch.equal(gathered, halved) and torch.equal(summoned, halved)


def test_an_edit_dropped_by_summon_without_writeback_leaves_the_masters_unrounded():
    # The edit inside the block bumps the parameter's version; the masters must not then take the
    # float32 compute values (rounding every float64 master).
    def run(backend):
        model, _ = wrap("zero2", net(), backend, mixed_precision=F32)
        masters = [m.detach().clone() for m in model.local_parameter_shard()]
        with model.summon_full_parameters(writeback=False), torch.no_grad():
            for p in model.module.parameters():
                p.mul_(0.5)
        model(torch.randn(2, 4))
        return all(torch.equal(a, b) for a, b in zip(masters, model.local_parameter_shard()))
    assert spawn(run, WORLD, timeout=60) == [True, True]


def test_parameters_kept_gathered_hold_the_current_weights_between_steps():
    # A unit kept gathered (replicate_below_numel) held the weights of before the step until the
    # next forward gathered it: a read or an edit between steps saw stale values.
    def run(backend):
        model, opt = wrap("zero3", net(), backend, replicate_below_numel=1000)
        model.train_step(rows(batches(1)[0], backend.rank), loss64, opt)
        held = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        return held, model.gather_full_parameters()
    for held, gathered in spawn(run, WORLD, timeout=60):
        for name, value in held.items():
            assert torch.equal(value, gathered[name]), name


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.lin(x) / self.temperature


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_write_into_a_resharded_parameter_is_refused_at_the_next_forward(strategy):
    # A one-element parameter of a resharded unit holds a NaN of its own, which fill_ wrote: the
    # write was silently lost at the next gather.
    def run(backend):
        with SEED_LOCK:
            torch.manual_seed(0)
            module = Scaled().double()
        model, opt = wrap(strategy, module, backend, auto_wrap_min_params=1)
        x, y = rows(batches(1)[0], backend.rank)
        model.train_step((x, y), loss64, opt)
        with torch.no_grad():
            model.module.temperature.fill_(0.5)
        with pytest.raises(ConfigError, match=r"'temperature'.*summon_full_parameters"):
            model.train_step((x, y), loss64, opt)
        return True
    assert spawn(run, WORLD, timeout=60) == [True, True]


def test_an_edit_inside_summon_is_not_taken_again():
    # Written back by the block; the next forward must not see it as an edit to refuse or redo.
    def run(backend):
        model, opt = wrap("zero3", net(), backend)
        with model.summon_full_parameters(), torch.no_grad():
            model.module.a.weight.mul_(0.5)
        expected = model.gather_full_parameters()
        model(torch.randn(2, 4, dtype=torch.float64))
        return expected, model.gather_full_parameters()
    for expected, got in spawn(run, WORLD, timeout=60):
        for name, value in expected.items():
            assert torch.equal(got[name], value), name

