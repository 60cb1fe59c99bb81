"""Training inside a user's CUDA stream (``with torch.cuda.stream(s):``) equals one process
training on the whole batch, on every engine that runs ranks on one GPU ([Note: the caller's
stream] in distframe/backends/cuda_streams.py).

Before, a call with ``async_op=True`` ran on the communication thread's own (default) stream, and
in-memory ranks read each other's tensors on their own streams, so a collective could read
gradients before the caller's stream wrote them: ZeRO-1 over Gloo ended 0.55 off one process,
ZeRO-2 over MPI 55, and an in-memory all_reduce of a tensor a side stream was still writing
returned partial sums. Kernels on a wide float64 model run long enough to show such a race.

Needs a CUDA device (streams are CUDA's); skipped elsewhere."""
from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

from distframe.launch import spawn
from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from distframe.optimizers import (DDPOptimizer, FSDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer,
                                  ZeRO3Optimizer)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STRATEGIES = {"ddp": (DDPModel, DDPOptimizer, {"bucket_cap_mb": 0.5}),
              "zero1": (ZeRO1Model, ZeRO1Optimizer, {"bucket_cap_mb": 0.5}),
              "zero2": (ZeRO2Model, ZeRO2Optimizer, {"bucket_cap_mb": 0.5}),
              "zero3": (ZeRO3Model, ZeRO3Optimizer, {}),
              "fsdp": (FSDPModel, FSDPOptimizer, {"auto_wrap_min_params": 100})}
WIDTH, DEPTH, STEPS, BATCH = 384, 3, 3, 64
TOL = dict(rtol=0, atol=1e-9)
_SEED_LOCK = threading.Lock()


def _model(device: str) -> nn.Module:
    with _SEED_LOCK:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                  for _ in range(DEPTH)]
        model = nn.Sequential(nn.Linear(6, WIDTH), *blocks, nn.Linear(WIDTH, 3))
    return model.to(device, torch.float64)


def _batches(device: str):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen, dtype=torch.float64).to(device),
             torch.randn(BATCH, 3, generator=gen, dtype=torch.float64).to(device))
            for _ in range(STEPS)]


def _loss(out, y):
    return nn.functional.mse_loss(out, y)


@functools.lru_cache(maxsize=None)
def _one_process() -> dict[str, torch.Tensor]:
    model = _model("cuda:0")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in _batches("cuda:0"):
        _loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}


def _train_in_a_stream(backend, strategy: str) -> dict[str, torch.Tensor]:
    model_class, optimizer_class, settings = STRATEGIES[strategy]
    model = model_class(_model("cuda:0"), backend, **settings)
    optimizer = optimizer_class(model, torch.optim.Adam, lr=1e-2)
    n = BATCH // backend.world_size
    part = slice(backend.rank * n, (backend.rank + 1) * n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, y in _batches("cuda:0"):
            model.train_step((x[part], y[part]), _loss, optimizer)
        full = {name: value.cpu() for name, value in model.gather_full_parameters().items()}
    torch.cuda.synchronize()
    return full


def _check(results) -> None:
    expected = _one_process()
    for full in results:
        assert full.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)


@pytest.fixture(scope="module", params=[pytest.param("gloo", marks=pytest.mark.gloo),
                                        pytest.param("mpi", marks=pytest.mark.mpi)])
def pool(request):
    if request.param == "mpi":
        from distframe._mpi_launch import MPIPool
        pool = MPIPool(2, timeout=300)
    else:
        from distframe._process_launch import ProcessPool
        pool = ProcessPool(2, "gloo", timeout=300)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_processes_sharing_the_gpu_train_in_a_user_stream_as_one_process(pool, strategy):
    _check(pool.run(functools.partial(_train_in_a_stream, strategy=strategy)))


# ZeRO-3 and FSDP cannot run on in-memory ranks sharing one GPU (tests/models/test_gpu.py).
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_in_memory_ranks_train_in_streams_of_their_own_as_one_process(strategy):
    _check(spawn(functools.partial(_train_in_a_stream, strategy=strategy), 2, timeout=120))


def _reduce_what_a_side_stream_writes(backend, async_op: bool) -> list[float]:
    errors = []
    stream = torch.cuda.Stream()
    for i in range(4):
        with torch.cuda.stream(stream):
            ones = torch.ones(4096, 4096, dtype=torch.float64, device="cuda")
            tensor = (ones @ ones)[0, :1024] * (backend.rank + 1 + i)  # a long kernel writes it
            work = backend.all_reduce(tensor, async_op=async_op)
            if async_op:
                work.wait()
            expected = 4096.0 * sum(r + 1 + i for r in range(backend.world_size))
            errors.append((tensor - expected).abs().max().item())
    return errors


@pytest.mark.parametrize("async_op", [False, True])
def test_in_memory_all_reduce_of_what_a_side_stream_writes(async_op):
    for errors in spawn(functools.partial(_reduce_what_a_side_stream_writes, async_op=async_op), 2):
        assert errors == [0.0] * 4
