"""A batch left on the host for a model on the GPU is moved to the model's device, as torch DDP
(with ``device_ids``) and FSDP2 move forward inputs: the data-parallel strategies failed in the
model's first layer with torch's "Expected all tensors to be on the same device". Targets given to
``train_step`` / ``forward_backward`` move with the inputs. Each run equals one process training
the CUDA model on CUDA batches (float64, 1e-10).

The GPU tests need a CUDA device; the first test runs everywhere."""
from __future__ import annotations

import functools

import pytest
import torch

from distframe.launch import spawn
from distframe.models.devices import inputs_on
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, BATCH = 3, 12


def test_host_tensors_anywhere_in_the_inputs_move_and_others_stay():
    other = torch.ones(1, device="meta")
    moved = inputs_on(torch.device("meta"), ((torch.ones(2), other), {"a": [torch.zeros(1), 3]}))
    (first, kept), rest = moved
    assert first.device.type == "meta" and kept is other
    assert rest["a"][0].device.type == "meta" and rest["a"][1] == 3
    plain = (torch.ones(2),)
    assert inputs_on(None, plain) is plain  # a CPU model's inputs are left as given


def _train_with_host_batches(backend, strategy, through_forward):
    model_class, optimizer_class = STRATEGIES[strategy]
    model = model_class(build_model().to("cuda"), backend, **SETTINGS[strategy])
    optimizer = optimizer_class(model, torch.optim.Adam, lr=1e-2)
    for batch in global_batches(STEPS, BATCH):
        x, y = rank_slice(batch, backend.rank, backend.world_size)  # on the host
        if through_forward:
            loss_fn(model(x), y.cuda()).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.train_step((x, y), loss_fn, optimizer)
    return {name: value.cpu() for name, value in model.gather_full_parameters().items()}


def _check(results):
    expected = reference_run(global_batches(STEPS, BATCH), device="cuda")[-1]
    for full in results:
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value.cpu(), **TOL, msg=name)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("through_forward", [False, True])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_in_memory_ranks_take_host_batches_for_a_gpu_model(strategy, through_forward):
    _check(spawn(functools.partial(_train_with_host_batches, strategy=strategy,
                                   through_forward=through_forward), 2, timeout=60))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_nccl_rank_takes_host_batches_for_a_gpu_model(strategy):
    _check(spawn(functools.partial(_train_with_host_batches, strategy=strategy, through_forward=False),
                 1, backend="nccl", timeout=120))
