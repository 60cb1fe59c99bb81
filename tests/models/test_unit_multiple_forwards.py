"""ZeRO-3/FSDP with several forwards before a backward (a siamese pair, a contrastive step): each
unit reduce-scatters its gradient once per backward pass, after the last of its backward runs,
and training matches one process (float64, 1e-10). Also when a forward's graph is not part of
the backward (run under no_grad, its output discarded, or left to a later backward), under
no_sync accumulation, retain_graph, activation checkpointing, with and without resharding."""
import contextlib
import functools

import pytest
import torch

from distframe.launch import spawn
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice
from tests.models.test_unit_patterns import universal

STEPS, BATCH, TOL = 2, 12, 1e-10

CASES = {
    "zero3": ("zero3", {}),
    "zero3-kept": ("zero3", {"reshard_after_forward": False}),
    "zero3-replicated": ("zero3", {"replicate_below_numel": 100}),
    "fsdp": ("fsdp", SETTINGS["fsdp"]),
    "fsdp-kept": ("fsdp", {**SETTINGS["fsdp"], "reshard_after_forward": False, "prefetch": False}),
}


# Each pattern: (model, x, y, context for backwards that must not synchronise) -> backward calls.
def siamese(model, x, y, quiet):
    (loss_fn(model(x), y) + loss_fn(model(0.5 * x), y)).backward()
    return 1


def three_forwards(model, x, y, quiet):
    out = model(x)
    (loss_fn(out, y) + loss_fn(model(out[:, :1] * x), y) + loss_fn(model(-x), y)).backward()
    return 1


def second_forward_without_grad(model, x, y, quiet):
    out = model(x)
    with torch.no_grad():
        model(0.5 * x)
    loss_fn(out, y).backward()
    return 1


def second_output_discarded(model, x, y, quiet):
    out = model(x)
    model(0.5 * x)
    loss_fn(out, y).backward()
    return 1


def first_output_discarded(model, x, y, quiet):
    model(0.5 * x)
    loss_fn(model(x), y).backward()
    return 1


def one_backward_per_forward(model, x, y, quiet):
    first, second = loss_fn(model(x), y), loss_fn(model(0.5 * x), y)
    first.backward()
    second.backward()
    return 2


def retained_graph(model, x, y, quiet):
    loss = loss_fn(model(x), y) + loss_fn(model(0.5 * x), y)
    (loss / 2).backward(retain_graph=True)
    (loss / 2).backward()
    return 2


def accumulated_under_no_sync(model, x, y, quiet):
    half = x.shape[0] // 2
    with quiet():
        (loss_fn(model(x[:half]), y[:half]) + loss_fn(model(-x[:half]), y[:half])).backward()
    (loss_fn(model(x[half:]), y[half:]) + loss_fn(model(-x[half:]), y[half:])).backward()
    return 1


PATTERNS = [siamese, three_forwards, second_forward_without_grad, second_output_discarded,
            first_output_discarded, one_backward_per_forward, retained_graph, accumulated_under_no_sync]


def reference(make_model, pattern):
    """One process, whole batches: the wrapped model's state dict after the last step."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in global_batches(STEPS, BATCH):
        pattern(model, x, y, quiet=contextlib.nullcontext)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train(backend, make_model, pattern, strategy, settings):
    """The state dict after the last step, and per step (reduce_scatter calls, bytes) against
    (backward calls x units, backward calls x the units' flat gradient bytes)."""
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(make_model(), backend, **settings)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    unit_bytes = sum(unit.full_bytes for unit in model.units)
    counts = []
    for batch in global_batches(STEPS, BATCH):
        x, y = rank_slice(batch, backend.rank, backend.world_size)
        backend.stats.reset()
        backwards = pattern(model, x, y, quiet=model.no_sync)
        stats = backend.stats.snapshot()
        counts.append(((stats["calls"].get("reduce_scatter"), stats["bytes"].get("reduce_scatter")),
                       (backwards * len(model.units), backwards * unit_bytes)))
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters(), counts


def assert_one_reduction_per_unit_and_backward(make_model, pattern, case, world=2):
    strategy, settings = CASES[case]
    expected = reference(make_model, pattern)
    run = functools.partial(train, make_model=make_model, pattern=pattern, strategy=strategy,
                            settings=settings)
    for params, counts in spawn(run, world, timeout=60):
        for got, wanted in counts:
            assert got == wanted
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.__name__ for p in PATTERNS])
def test_each_unit_is_reduced_once_per_backward_after_several_forwards(pattern, case):
    # Each unit's gradients were reduce-scattered once per forward (the siamese step: 11
    # reductions for ZeRO-3's 6 units, all but the first unit twice).
    assert_one_reduction_per_unit_and_backward(build_model, pattern, case)


def test_three_ranks():
    assert_one_reduction_per_unit_and_backward(build_model, siamese, "zero3", world=3)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("case", ["zero3", "zero3-kept", "fsdp"])
@pytest.mark.parametrize("pattern", [siamese, second_output_discarded],
                         ids=["siamese", "second_output_discarded"])
def test_a_checkpointed_unit_applied_several_times_in_several_forwards(pattern, case, checkpointing):
    # The block runs three times per forward; FSDP's units: inp, block, the root (with out).
    make_model = functools.partial(universal, checkpointing)
    assert_one_reduction_per_unit_and_backward(make_model, pattern, case)

