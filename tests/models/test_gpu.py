"""Strategies and optimizers on a CUDA model: in-memory ranks (threads sharing one GPU) train it
exactly like one process training the same CUDA model on the whole batch (float64, 1e-10), and
every tensor a strategy makes for the model (flat spaces, gradient buckets, received
activations, gathered parameters, optimizer state, checkpoints) stays on the model's GPU.

ZeRO-3, FSDP and tensor parallelism wait for collectives inside backward, which in-memory ranks
sharing one GPU cannot do (torch runs every thread's backward on one autograd thread per GPU; see
docs/design.md): they run on the GPU in tests/train/test_gpu.py, over NCCL with one process per
GPU, and here the in-memory run of ZeRO-3 is shown to stop with CollectiveTimeoutError at once,
saying why.

Needs a CUDA device; skipped elsewhere (``DISTFRAME_TEST_DEVICE=cpu`` runs the same checks on
the CPU, to try the tests themselves on a machine without a GPU)."""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.errors import CollectiveTimeoutError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import DDPModel, HybridShardedModel
from distframe.optimizers import AsyncSGDOptimizer, GradientCompressionOptimizer
from distframe.optimizers.compression import Int8Compressor, PowerSGDCompressor, TopKCompressor
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, lm_loss,
                                 loss_fn, rank_slice, reference_run, tiny_lm)
from tests.models.test_hybrid import batches as lm_batches
from tests.models.test_hybrid import reference_training
from tests.models.test_pipeline import _pipeline_run, _reference, data, sequential

DEVICE = torch.device(os.environ.get("DISTFRAME_TEST_DEVICE", "cuda"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, BATCH = 4, 12


def on_device(batch):
    return tuple(t.to(DEVICE) for t in batch)


def assert_on_device(tensors, what):
    off = [k for k, t in tensors.items() if t.device.type != DEVICE.type]
    assert not off, f"{what}: {off} are not on {DEVICE}"


def train_data_parallel(backend, strategy, steps=STEPS):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model().to(DEVICE), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    for global_batch in global_batches(steps, BATCH):
        model.train_step(on_device(rank_slice(global_batch, backend.rank, backend.world_size)),
                         loss_fn, opt)
    held = {f"param {i}": p for i, p in enumerate(model.parameters())}
    held.update({f"grad {i}": p.grad for i, p in enumerate(model.parameters()) if p.grad is not None})
    held.update({f"state {i} {k}": v for i, s in enumerate(opt.wrapped_optimizer.state.values())
                 for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    return model.gather_full_parameters(), held


SHARED_GPU = ["ddp", "zero1", "zero2"]  # the end-of-backward wait moves to the step (deferred_finish)


@pytest.mark.parametrize("strategy", SHARED_GPU)
def test_data_parallel_strategies_train_like_one_process(strategy):
    expected = reference_run(global_batches(STEPS, BATCH), device=DEVICE)[-1]
    for full, held in spawn(lambda b: train_data_parallel(b, strategy), 2, timeout=30):
        assert_on_device(full, f"{strategy} gathered parameters")
        assert_on_device(held, f"{strategy} parameters, gradients and optimizer state")
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, **TOL, msg=f"{strategy} {name}")


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the limit is the GPU's autograd thread")
def test_the_torch_ddp_loop_on_ranks_sharing_a_gpu_steps_on_the_average():
    """backward, step with a plain optimizer: the average that cannot be waited for on the GPU's
    autograd thread completes at the step, with a warning saying so (not a stall)."""
    def run(b):
        model = DDPModel(build_model().to(DEVICE), b, **SETTINGS["ddp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for global_batch in global_batches(STEPS, BATCH):
            x, y = on_device(rank_slice(global_batch, b.rank, b.world_size))
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()
    expected = reference_run(global_batches(STEPS, BATCH), device=DEVICE)[-1]
    with pytest.warns(RuntimeWarning, match="share this rank's GPU"):
        results = spawn(run, 2, timeout=30)
    for full in results:
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the limit is the GPU's autograd thread")
def test_zero3_on_ranks_sharing_a_gpu_stops_at_once_saying_why():
    """Not at the 60 s timeout: after a second, with the reason and the fix."""
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="all_gather.*autograd thread for cuda"):
        spawn(lambda b: train_data_parallel(b, "zero3", steps=1), 2, timeout=60)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("strategy", SHARED_GPU)
def test_checkpoint_of_a_cuda_model_loads_back_on_the_gpu(strategy, tmp_path):
    model_cls, opt_cls = STRATEGIES[strategy]

    def run(b):
        model = model_cls(build_model().to(DEVICE), b, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        batch = on_device(rank_slice(global_batches(1, BATCH)[0], b.rank, b.world_size))
        model.train_step(batch, loss_fn, opt)
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)
        saved = {k: v.clone() for k, v in model.gather_full_parameters().items()}
        other = model_cls(build_model(seed=7).to(DEVICE), b, **SETTINGS[strategy])
        other_opt = opt_cls(other, torch.optim.Adam, lr=1e-2)
        assert checkpoint.load(tmp_path / "ckpt", other, other_opt)["step"] == 1
        loaded = other.gather_full_parameters()
        assert_on_device(loaded, "loaded parameters")
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
        # The loaded optimizer state takes the next step exactly like the saved one.
        model.train_step(batch, loss_fn, opt)
        other.train_step(batch, loss_fn, other_opt)
        return model.gather_full_parameters(), other.gather_full_parameters()

    for a, b in spawn(run, 2, timeout=30):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_equals_the_unsplit_model(schedule):
    model = sequential().to(DEVICE)
    x, y = on_device(data(12))
    loss, out, grads = _reference(model, x, y)
    seen = set()
    for rank_loss, rank_out, rank_grads in spawn(
            lambda b: _pipeline_run(b, model, x, y, 4, schedule), 2, timeout=30):
        assert rank_out.device.type == DEVICE.type
        torch.testing.assert_close(rank_out, out, **TOL)
        assert rank_loss == pytest.approx(loss, rel=1e-12)
        assert_on_device(rank_grads, "stage gradients")
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], **TOL, msg=name)
        seen |= set(rank_grads)
    assert seen == set(grads)


@pytest.mark.parametrize("dp,tp,pp", [(2, 1, 1), (1, 1, 2), (2, 1, 2)])
def test_hybrid_lm_trains_like_one_process(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    losses, expected = reference_training(DEVICE)

    def run(b):
        model = HybridShardedModel(tiny_lm().to(DEVICE), b, dims=dims, num_microbatches=2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        got = []
        for batch in lm_batches():
            x, y = batch
            per = x.shape[0] // dp
            part = slice(model.groups.dp_index * per, (model.groups.dp_index + 1) * per)
            got.append(float(model.train_step(on_device((x[part], y[part])), lm_loss, opt)))
        with torch.no_grad():
            out = model(on_device(lm_batches()[0])[0])
        return got, model.gather_full_parameters(), out.device.type

    for got, full, out_device in spawn(run, dims.world_size, timeout=30):
        assert got == pytest.approx(losses, rel=1e-12)
        assert out_device == DEVICE.type
        assert_on_device(full, "gathered LM parameters")
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)


# ---- optimizers beyond data parallelism: the CUDA run equals the same run on the CPU -----------
MLP_SEED = 1234


def mlp():
    from tests.models.common import SEED_LOCK
    with SEED_LOCK:
        torch.manual_seed(MLP_SEED)
        return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(),
                             nn.Linear(16, 3)).double()


def mlp_batch(step, rank, world, device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = torch.randn(12, 3, generator=g, dtype=torch.float64)
    n = 12 // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


COMPRESSORS = {"int8-stochastic": lambda: Int8Compressor(chunk_size=32),
               "topk": lambda: TopKCompressor(0.1),
               "powersgd": lambda: PowerSGDCompressor(rank=2, start_iter=1)}


def train_compressed(device, compressor, steps=5):
    def run(b):
        model = DDPModel(mlp().to(device), b, bucket_cap_mb=0.001)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9,
                                           compressor=COMPRESSORS[compressor]())
        for step in range(steps):
            model.train_step(mlp_batch(step, b.rank, b.world_size, device),
                             nn.functional.mse_loss, opt)
        return model.gather_full_parameters()
    return spawn(run, 2, timeout=30)


@pytest.mark.parametrize("compressor", list(COMPRESSORS))
def test_gradient_compression_on_the_gpu_equals_the_cpu(compressor):
    on_cpu = train_compressed(torch.device("cpu"), compressor)
    for rank, full in enumerate(train_compressed(DEVICE, compressor)):
        assert_on_device(full, f"{compressor} parameters")
        for name, value in on_cpu[rank].items():
            torch.testing.assert_close(full[name].cpu(), value, **TOL, msg=f"{compressor} {name}")


def train_async(device, steps=4):
    def run(b):
        model = DDPModel(mlp().to(device), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.05, deterministic=True)
        if opt.is_server:
            opt.serve()
            return model.gather_full_parameters()
        for step in range(steps):
            opt.train_step(mlp_batch(step, b.rank, b.world_size, device), nn.functional.mse_loss)
        opt.finish()
        return None
    return spawn(run, 3, timeout=30)[0]


def test_async_sgd_on_the_gpu_equals_the_cpu():
    on_cpu, on_gpu = train_async(torch.device("cpu")), train_async(DEVICE)
    assert_on_device(on_gpu, "server parameters")
    for name, value in on_cpu.items():
        torch.testing.assert_close(on_gpu[name].cpu(), value, **TOL, msg=name)
