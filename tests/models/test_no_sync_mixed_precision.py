"""Gradient accumulation under ``no_sync`` with a mixed-precision policy: the micro-steps'
gradients add up in ``reduce_dtype`` (float32), as FSDP2 accumulates them, not in the bfloat16
the backward computes them in. Each micro-step's bfloat16 gradient then counts exactly once; in
bfloat16 (8 bits of mantissa) every addition rounded the sum, about 0.4% a time."""
import pytest
import torch

from distframe.launch import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
K, WORLD, MICRO = 4, 2, 3


def _micro_batches():
    """Micro-batch j of rank r, for every (j, r)."""
    big = global_batches(1, K * WORLD * MICRO, torch.float32)[0]
    return {(j, r): rank_slice(big, j * WORLD + r, K * WORLD) for j in range(K) for r in range(WORLD)}


def _reference_update(steps=range(K)):
    """The step SGD(lr=1) takes from bfloat16 micro-gradients (of micro-steps ``steps``)
    summed in float32 and averaged over the ranks: each is what one rank's micro-step computes
    (bfloat16 weights, the same rows), so the sum is exact up to float32 rounding."""
    model = build_model(torch.float32).to(torch.bfloat16)
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    for (j, r), (x, y) in _micro_batches().items():
        if j not in steps:
            continue
        model.zero_grad()
        (loss_fn(model(x.bfloat16()).float(), y) / K).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad.float()
    return {n: g / WORLD for n, g in total.items()}


@pytest.mark.parametrize("cleared", [False, True])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_no_sync_accumulates_in_the_reduce_dtype(strategy, cleared):
    # cleared: zero_grad before the last micro-step drops what no_sync kept aside
    batches = _micro_batches()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(torch.float32), backend, mixed_precision=POLICY, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=1.0)
        before = model.gather_full_parameters()
        for j in range(K):
            x, y = batches[(j, backend.rank)]
            if cleared and j == K - 1:
                opt.zero_grad()
            with model.no_sync() if j < K - 1 else torch.enable_grad():
                (loss_fn(model(x.bfloat16()).float(), y) / K).backward()
        opt.step()
        after = model.gather_full_parameters()
        return {n: before[n] - after[n] for n in before}

    expected = _reference_update([K - 1] if cleared else range(K))
    for update in spawn(run, WORLD):
        for name, value in expected.items():
            # float32 rounding of the master's subtraction: ~1e-8; bfloat16 accumulation: ~1e-4
            torch.testing.assert_close(update[name], value, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_the_sum_kept_aside_is_counted_in_the_memory_footprint(strategy):
    """Counted from the tensors' storage (memory_footprint's 'buffers'): one float32 element per
    flat element of every bucket or unit while micro-steps accumulate, none once reduced."""
    batches = _micro_batches()

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(torch.float32), backend, mixed_precision=POLICY, **SETTINGS[strategy])
        opt_cls(model, torch.optim.SGD, lr=1.0)
        x, y = batches[(0, backend.rank)]
        before = model.memory_footprint()["buffers"]
        with model.no_sync():
            loss_fn(model(x.bfloat16()).float(), y).backward()
        during = model.memory_footprint()["buffers"]
        loss_fn(model(x.bfloat16()).float(), y).backward()
        after = model.memory_footprint()["buffers"]
        spaces = model.spaces if strategy == "zero2" else [u.space for u in model.units]
        return during - before, after - before, 4 * sum(s.padded_numel for s in spaces)

    for grew, left, expected in spawn(run, WORLD):
        assert grew == expected and left <= 0
