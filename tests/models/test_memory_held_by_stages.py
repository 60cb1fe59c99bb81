"""A pipeline (or hybrid pp > 1) rank holds its stage's parameters only. The wrapper kept the
module it was given for the base class's forward (``_call``), which a model-parallel wrapper never
calls: every rank of a 4-stage pipeline held the whole dense model, 4x its stage's parameters,
once the user had dropped their reference to it. Each in-memory rank checks, by weak reference to
the dense model's parameters and by walking what the wrapper reaches, that only its stage's
parameters (or their tensor-parallel slices) are alive, then trains a step."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, PipelineParallelModel
from tests.models.common import SEED_LOCK, lm_loss, tiny_lm
from tests.models.test_memory_and_communication import reachable_storage_bytes

GC_LOCK = threading.Lock()  # one rank's gc walk at a time: the others keep building and training


def dense_mlp() -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]).double()


def storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


CASES = {  # name: (world size, the dense model's builder, how it is wrapped)
    "pipeline pp2": (2, dense_mlp, lambda m, b: PipelineParallelModel(m, b, num_microbatches=2)),
    "pipeline pp4": (4, dense_mlp, lambda m, b: PipelineParallelModel(m, b, num_microbatches=2)),
    "pipeline pp2, tied LM": (2, tiny_lm, lambda m, b: PipelineParallelModel(m, b, num_microbatches=2)),
    "hybrid dp2 pp2": (4, dense_mlp, lambda m, b: HybridShardedModel(
        m, b, dims=ParallelDims(dp=2, pp=2), num_microbatches=2)),
    "hybrid tp2 pp2": (4, tiny_lm, lambda m, b: HybridShardedModel(
        m, b, dims=ParallelDims(tp=2, pp=2), num_microbatches=2)),
}


def _batch(model_name: str):
    g = torch.Generator().manual_seed(1)
    if model_name == "tiny_lm":
        tokens = torch.randint(0, 256, (2, 4, 16), generator=g)
        return (tokens[0], tokens[1]), lm_loss
    return (torch.randn(4, 16, generator=g, dtype=torch.float64),
            torch.randn(4, 16, generator=g, dtype=torch.float64)), F.mse_loss


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stage_holds_only_its_own_parameters(case):
    world, build, wrap = CASES[case]

    def run(backend):
        dense = build()
        whole = storage_bytes(dense.parameters())
        refs = [weakref.ref(p) for p in dense.parameters()]
        model = wrap(dense, backend)
        del dense  # the user keeps no reference to the dense model
        with GC_LOCK:
            gc.collect()
            alive = {id(r()) for r in refs if r() is not None}
            own = list(model.parameters())
            reached = reachable_storage_bytes(model)
        stage = storage_bytes(own)
        assert stage < whole, (stage, whole)
        assert alive <= {id(p) for p in own}, f"{len(alive - {id(p) for p in own})} dense parameter(s) alive"
        held = storage_bytes(list(own) + list(model.wrapped_model.buffers()))
        assert reached == held, f"the wrapper reaches {reached} bytes, its stage holds {held}"
        batch, loss_fn = _batch(build.__name__)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        loss = model.train_step(batch, loss_fn, opt)
        with GC_LOCK:  # nothing the step made (the runner's state, hooks) holds the dense model
            gc.collect()
            assert {id(r()) for r in refs if r() is not None} <= {id(p) for p in own}
        return loss

    losses = spawn(run, world, timeout=60)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)
