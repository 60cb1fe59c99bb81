"""On a CUDA model, in-memory ranks sharing one GPU (where the end-of-backward average moves to the
step, deferred_finish.py): a direct call of the module DDP wraps, and a step after backward passes
all under no_sync, train as one process on the whole batch (float64, 1e-10), as on the CPU
(test_mistakes2_ddp_direct_calls.py, test_mistakes2_step_after_no_sync.py). Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from distframe.launch import spawn
from distframe.models import DDPModel
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:in-memory ranks .* share this rank's GPU")]
TOL = dict(rtol=0, atol=1e-10)
DATA = global_batches(3, 12)


def test_a_direct_call_on_ranks_sharing_a_gpu_trains_as_one_process():
    def run(backend):
        net = build_model().cuda()
        model = DDPModel(net, backend, **SETTINGS["ddp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for batch in DATA:
            x, y = (t.cuda() for t in rank_slice(batch, backend.rank, backend.world_size))
            loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()

    expected = reference_run(DATA, device="cuda")[-1]
    for params in spawn(run, 2, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_a_step_after_no_sync_on_ranks_sharing_a_gpu_trains_as_one_process(strategy):
    k, world = 3, 2
    big = global_batches(1, 4 * k * world)[0]

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model().cuda(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for j in range(k):
            x, y = (t.cuda() for t in rank_slice(big, j * world + backend.rank, k * world))
            with model.no_sync():
                (loss_fn(model(x), y) / k).backward()
        opt.step()
        return model.gather_full_parameters()

    expected = reference_run([big], device="cuda")[0]
    for params in spawn(run, world, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)
