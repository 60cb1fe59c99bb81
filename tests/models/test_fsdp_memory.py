"""Peak live tensor storage of one FSDP / ZeRO-3 training step, counted at every unit's lifecycle
point, against the sharded state plus a few gathered units (never the whole model); and of the
ZeRO-1/2 parameter all_gather, against the chunks it sends.

Ranks are gloo processes so each count is one rank's own: every tensor the process holds (any
object's reference, the communication thread's pending results included), each storage once.
"""
import functools
import gc

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from tests.models.common import STRATEGIES, loss_fn

WIDTH, LAYERS, ROWS = 256, 12, 2   # a unit per Linear: 263 KB each; activations are 2 KB


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python in this process."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no __class__ lookups
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def sample_at_lifecycle_points(units, samples: list[int]) -> None:
    """Appends live_tensor_bytes() after each unit's pre_forward, post_forward, pre_backward and
    every gradient accumulation (hooks registered after the model's, so they see its work)."""
    def sample(*_):
        samples.append(live_tensor_bytes())

    def after_forward(module, args, output):
        sample()
        if output.requires_grad:
            output.register_hook(sample)
    for unit in units:
        unit.module.register_forward_pre_hook(sample)
        unit.module.register_forward_hook(after_forward)
        for param in unit.params:
            param.register_post_accumulate_grad_hook(sample)


def _trained_twice(backend, strategy, **settings):
    """(model, optimizer, batch): the MLP under ``strategy`` after two steps, so optimizer state
    exists and prefetch knows the order."""
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(nn.Sequential(*layers), backend, **settings)
    opt = opt_cls(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(backend.rank)
    batch = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    for _ in range(2):
        model.train_step(batch, loss_fn, opt)
    return model, opt, batch


def _measure(backend, strategy):
    settings = {"auto_wrap_min_params": WIDTH * WIDTH} if strategy == "fsdp" else {}
    model, opt, batch = _trained_twice(backend, strategy, **settings)
    samples: list[int] = []
    sample_at_lifecycle_points(model.units, samples)
    gc.collect()
    before = live_tensor_bytes()  # masters and optimizer state; no gradients between steps
    model.train_step(batch, loss_fn, opt)
    shard_gradients = sum(u.master.numel() * u.master.element_size() for u in model.units)
    model_bytes = sum(u.full_bytes for u in model.units)
    return max(samples) - before, shard_gradients, model.largest_unit_bytes(), model_bytes, len(samples)


@pytest.mark.gloo
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_peak_live_storage_of_a_step_is_the_shards_plus_a_few_units(strategy):
    for peak, shard_gradients, unit, model_bytes, count in spawn(
            functools.partial(_measure, strategy=strategy), 2, "gloo", timeout=120):
        assert count >= 4 * LAYERS
        assert model_bytes >= LAYERS * unit
        # Above the state held between steps: the gradient shards, the unit computing and the
        # one prefetched (parameters), and the unit's unsharded gradients with their flattened
        # copy for the reduce_scatter; activations are a few KB. Gathered copies kept alive
        # until the step ends would instead grow with the model (see sharded_unit.py).
        bound = shard_gradients + 2 * unit + 2 * unit + 64 * 1024
        assert peak <= bound, (f"peak live storage {peak / 2**20:.2f} MiB above the step's start "
                               f"exceeds {bound / 2**20:.2f} MiB (gradient shards + 2 gathered units "
                               f"+ 2 units of gradients; one unit is {unit / 2**20:.2f} MiB)")


class _SampledWork:
    """A pending all_gather whose wait() samples the live storage once the result exists."""

    def __init__(self, work, samples: list[int]) -> None:
        self._work, self._samples = work, samples

    def wait(self, timeout=None):
        result = self._work.wait(timeout)
        self._samples.append(live_tensor_bytes())
        return result


def _measure_parameter_gather(backend):
    """For ZeRO-1 and ZeRO-2: live storage above the state between steps while
    synchronize_parameters all-gathers the updated chunks, and the chunks' bytes."""
    results = {}
    for strategy in ("zero1", "zero2"):
        model = _trained_twice(backend, strategy, bucket_cap_mb=1)[0]
        samples: list[int] = []
        gather = backend.all_gather
        backend.all_gather = lambda *a, **k: _SampledWork(gather(*a, **k), samples)
        gc.collect()
        before = live_tensor_bytes()
        try:
            model.synchronize_parameters()
        finally:
            del backend.all_gather
        chunks = sum(m.numel() * m.element_size() for m in model.masters)
        full = sum(f.numel() * f.element_size() for f in model.flat_parameters)
        results[strategy] = (max(samples) - before, chunks, full, len(samples))
    return results


@pytest.mark.gloo
def test_zero_parameter_gather_needs_only_chunk_sized_buffers():
    """The all_gather after the update writes straight into the flat parameters: what it adds
    is a copy of each bucket's chunk (its input), not a second full-size parameter buffer."""
    for results in spawn(_measure_parameter_gather, 2, "gloo", timeout=120):
        for strategy, (peak, chunks, full, count) in results.items():
            assert count >= 3, strategy  # several buckets, each sampled
            assert full >= 2 * chunks - 1024
            assert peak <= chunks + 16 * 1024, (
                f"{strategy}: the parameter all_gather held {peak / 2**20:.2f} MiB above the state "
                f"between steps; its chunk copies are {chunks / 2**20:.2f} MiB (the full flat "
                f"parameters {full / 2**20:.2f} MiB)")
