"""torch.compile with the strategies on GPUs, with inductor (Triton kernels): the cases of
tests/models/test_torch_compile.py (a pipeline of compiled blocks too) on CUDA models, over NCCL
(one rank per GPU), Gloo and MPI (two ranks sharing GPU 0; MPI stages through host memory unless
it is CUDA-aware). Each must equal one process training the same CUDA model on the whole batch,
in float64 to 1e-10, with graphs made.

Needs a CUDA device; skipped elsewhere. ``DISTFRAME_TEST_DEVICE=cpu`` runs the same checks on the
CPU (inductor then needs a C compiler), to try the tests on a machine without a GPU."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from distframe.backends.torch_dist import visible_gpus
from tests.models.common import global_batches, reference_run
from tests.models.test_torch_compile import (BATCH, STEPS, _mlp, _train, _train_compiled,
                                             _train_pipeline, _train_tensor_parallel)

DEVICE = os.environ.get("DISTFRAME_TEST_DEVICE", "cuda")
GPUS = visible_gpus() if DEVICE == "cuda" else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and GPUS == 0, reason="needs a CUDA device")]
COMPILER = "inductor"
REFERENCE_DEVICE = "cpu" if DEVICE == "cpu" else "cuda:0"  # where one process trains the reference
ENGINES = [pytest.param("nccl", marks=pytest.mark.skipif(GPUS == 0, reason="NCCL needs a GPU")),
           pytest.param("gloo", marks=pytest.mark.gloo), pytest.param("mpi", marks=pytest.mark.mpi)]


@pytest.fixture(scope="module", params=ENGINES)
def pool(request):
    if request.param == "mpi":
        from distframe._mpi_launch import MPIPool
        pool = MPIPool(2, timeout=300)
    else:
        from distframe._process_launch import ProcessPool
        pool = ProcessPool(min(GPUS, 2) if request.param == "nccl" else 2, request.param, timeout=300)
    yield pool
    pool.close()


def rank_device(backend) -> str:
    """An NCCL rank's own GPU; Gloo and MPI ranks share the reference's device."""
    own = getattr(backend, "_device", None)
    return str(own) if own is not None and own.type == "cuda" else REFERENCE_DEVICE


def _on_rank_device(backend, fn, **kwargs):
    return fn(backend, device=rank_device(backend), compiler=COMPILER, **kwargs)


def _one_process() -> dict[str, torch.Tensor]:
    """Parameters after one process trains the model on the whole batches, on the CPU."""
    final = reference_run(global_batches(STEPS, BATCH), device=REFERENCE_DEVICE)[-1]
    return {name: value.cpu() for name, value in final.items()}


@pytest.mark.parametrize("strategy,where", [
    ("ddp", "outer"), ("zero2", "inner"), ("zero3", "inner"), ("zero3", "blocks"), ("zero3", "outer"),
    ("fsdp", "blocks"), ("fsdp", "outer")])
def test_compiled_training_on_the_gpu_equals_one_process(pool, strategy, where):
    expected = _one_process()
    task = functools.partial(_on_rank_device, fn=_train_compiled, strategy=strategy, where=where)
    for params, graphs in pool.run(task):
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
        assert graphs > 0, "nothing was compiled"


def test_tensor_parallel_compiled_whole_on_the_gpu_equals_dense(pool):
    dense = _mlp(REFERENCE_DEVICE)
    _train(dense, dense, global_batches(STEPS, BATCH), REFERENCE_DEVICE)
    for params, graphs in pool.run(functools.partial(_on_rank_device, fn=_train_tensor_parallel)):
        for name, value in dense.state_dict().items():
            torch.testing.assert_close(params[name], value.cpu(), rtol=0, atol=1e-10, msg=name)
        assert graphs > 0, "nothing was compiled"


def test_pipeline_of_compiled_blocks_on_the_gpu_equals_one_process(pool):
    expected = _one_process()
    seen = set()
    for params, graphs in pool.run(functools.partial(_on_rank_device, fn=_train_pipeline, schedule="1f1b")):
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-10, msg=name)
        seen |= params.keys()
        assert graphs > 0, "nothing was compiled"
    assert seen == expected.keys()
