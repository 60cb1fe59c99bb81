"""ZeRO-2 holds a bucket's full gradient buffer only from its first gradient to its reduce_scatter,
with at most two reductions in flight. Every bucket's buffer used to be allocated (zeros) at the
start of each forward with grad, so a rank held the whole model's gradients through forward and
backward, on top of its gradient shards: its peak was no lower than ZeRO-1's (2.06x the parameter
bytes after forward, for 1.0 expected). See [Note: buffers on first use] in gradient_buckets.py.

Ranks are gloo processes, so each count is one rank's own, of real storage (bench/_storage.py):
every distinct tensor storage the process reaches, and the peak over backward of the storages
alive (those made on the rank's thread counted from every op's outputs; a communication thread's
scratch is not seen, as that module says)."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from bench._storage import live_peak, reachable_bytes
from distframe.launch import spawn
from tests.models.common import STRATEGIES, loss_fn

WIDTH, LAYERS, ROWS = 128, 16, 2  # one bucket per Linear (66 KB); activations are 1 KB each
BUCKET_MB = WIDTH * (WIDTH + 1) * 4 / 2**20


def _measure(backend, strategy):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(backend.rank)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    start = reachable_bytes()
    torch.manual_seed(0)
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]), backend,
                      bucket_cap_mb=BUCKET_MB, first_bucket_cap_mb=BUCKET_MB)
    opt = opt_cls(model, torch.optim.SGD, lr=1e-3, momentum=0.9)
    for _ in range(2):  # momentum and every lazy buffer exist
        model.train_step((x, y), loss_fn, opt)
    between = reachable_bytes()
    out = model(x)
    after_forward = reachable_bytes()
    loss = loss_fn(out, y)
    del out
    peak = live_peak(lambda: (loss.backward(), model.synchronize_gradients()))
    full = 4 * sum(p.numel() for p in model.wrapped_model.parameters())
    shards = sum(m.numel() * m.element_size() for m in model.masters)
    return dict(between=between - start, after_forward=after_forward - between, peak=peak - start,
                full=full, shards=shards, buckets=len(model.gradient_buckets.buckets))


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_zero2_holds_a_few_gradient_buckets_not_the_whole_gradient(world):
    results = {s: spawn(functools.partial(_measure, strategy=s), world, "gloo", timeout=120)
               for s in ("zero1", "zero2")}
    for zero1, zero2 in zip(results["zero1"], results["zero2"]):
        full, bucket = zero2["full"], zero2["full"] / LAYERS
        assert zero2["buckets"] == LAYERS
        # After the forward: its activations (16 KB), no gradient buffer yet (it held all 16).
        assert zero2["after_forward"] <= bucket, (zero2["after_forward"] / full, bucket / full)
        # During backward: above the state between steps (parameters, momentum shards) only the
        # gradient shards, the bucket filling, the two being reduced (each with its output) and a
        # gradient on its way into its bucket.
        above = zero2["peak"] - zero2["between"]
        assert above <= zero2["shards"] + 5 * bucket, (
            f"ZeRO-2 held {above / full:.2f}x the parameter bytes above its state between steps "
            f"in backward; gradient shards {zero2['shards'] / full:.2f}x, one bucket {1 / LAYERS:.2f}x")
        # ZeRO-1 keeps the whole gradient: ZeRO-2's peak is below it by that, less its shards.
        saved = zero1["peak"] - zero2["peak"]
        assert saved >= full - zero2["shards"] - 5 * bucket, (zero1["peak"] / full, zero2["peak"] / full)
