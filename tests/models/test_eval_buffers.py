"""Evaluating after a training step: every rank computes with rank 0's buffers (BatchNorm's running
statistics), as under torch DDP, whose next forward broadcasts them. Here they are sent when the
step's gradients are synchronised, so an evaluation under ``torch.no_grad()`` communicates
nothing and may run on rank 0 alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK, SETTINGS, STRATEGIES

WORLD, STEPS = 2, 2


def batch_norm_model() -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()


def batches(steps: int = STEPS, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 4, generator=g, dtype=torch.float64),
             torch.randn(size, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def own_slice(batch, index: int, count: int = WORLD):
    per = batch[0].shape[0] // count
    return batch[0][index * per:(index + 1) * per], batch[1][index * per:(index + 1) * per]


PROBE = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)


def single_process_eval(full: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the unwrapped model computes in eval mode with ``full`` (rank 0's buffers)."""
    plain = batch_norm_model()
    plain.load_state_dict(full)
    plain.eval()
    with torch.no_grad():
        return plain(PROBE)


def _train_then_eval(backend, strategy: str, accumulation_steps: int = 1):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(batch_norm_model(), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.SGD, lr=0.1)
    for batch in batches():
        model.train_step(own_slice(batch, backend.rank), F.mse_loss, opt,
                         accumulation_steps=accumulation_steps)
    model.eval()
    broadcasts = backend.stats.calls["broadcast"]
    with torch.no_grad():
        out = model(PROBE)
    no_grad_broadcasts = backend.stats.calls["broadcast"] - broadcasts
    with_grad = model(PROBE).detach()  # an evaluation with grad (saliency): the same buffers
    return out, with_grad, no_grad_broadcasts, model.gather_full_parameters()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_every_rank_evaluates_with_rank_0_buffers_after_a_step(strategy, accumulation_steps):
    # Each rank's BatchNorm saw its own slice; the evaluation used each rank's own statistics.
    results = spawn(lambda b: _train_then_eval(b, strategy, accumulation_steps), WORLD, timeout=60)
    expected = single_process_eval(results[0][3])
    for rank, (out, with_grad, no_grad_broadcasts, full) in enumerate(results):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=f"rank {rank}")
        torch.testing.assert_close(with_grad, expected, rtol=0, atol=1e-10, msg=f"rank {rank}")
        assert no_grad_broadcasts == 0  # nothing sent in a forward without grad
        for name, value in results[0][3].items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)


def _evaluate_on_rank_0_only(backend):
    model = STRATEGIES["ddp"][0](batch_norm_model(), backend, **SETTINGS["ddp"])
    opt = STRATEGIES["ddp"][1](model, torch.optim.SGD, lr=0.1)
    outputs = []
    for batch in batches():
        model.train()
        model.train_step(own_slice(batch, backend.rank), F.mse_loss, opt)
        if backend.rank == 0:  # a rank-0-only evaluation, no_grad and with grad, must not wait for peers
            model.eval()
            with torch.no_grad():
                outputs.append(model(PROBE))
            outputs.append(model(PROBE).detach())
    return outputs, model.gather_full_parameters()


def test_an_evaluation_on_rank_0_alone_communicates_nothing():
    results = spawn(_evaluate_on_rank_0_only, WORLD, timeout=20)
    outputs, full = results[0]
    assert len(outputs) == 2 * STEPS
    torch.testing.assert_close(outputs[-1], single_process_eval(full), rtol=0, atol=1e-10)
    for name, value in full.items():  # the training after it stayed in step on every rank
        torch.testing.assert_close(results[1][1][name], value, rtol=0, atol=0, msg=name)


def _forward_without_backward(backend, strategy: str):
    # A forward with grad whose backward never runs changes the statistics on each rank; the next
    # synchronising forward still starts from rank 0's, as before each such forward.
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(batch_norm_model(), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.SGD, lr=0.1)
    first, second = batches()
    x, y = own_slice(first, backend.rank)
    model(x)  # no backward
    model.train_step((x, y), F.mse_loss, opt)
    model.train_step(own_slice(second, backend.rank), F.mse_loss, opt)
    model.eval()
    with torch.no_grad():
        return model(PROBE), model.gather_full_parameters()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_forward_without_backward_then_steps_leaves_every_rank_with_rank_0_buffers(strategy):
    results = spawn(lambda b: _forward_without_backward(b, strategy), WORLD, timeout=60)
    expected = single_process_eval(results[0][1])
    for out, _ in results:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


def _hybrid_train_then_eval(backend, pp: int):
    model = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(dp=2, pp=pp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    index = model.groups.dp_index
    for batch in batches():
        model.train_step(own_slice(batch, index), F.mse_loss, opt)
    model.eval()
    with torch.no_grad():
        out = model(PROBE)
    return out, model.gather_full_parameters()


@pytest.mark.parametrize("pp", [1, 2])
def test_hybrid_replicas_evaluate_with_replica_0_buffers(pp):
    results = spawn(lambda b: _hybrid_train_then_eval(b, pp), 2 * pp, timeout=60)
    expected = single_process_eval(results[0][1])
    for rank, (out, _) in enumerate(results):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=f"rank {rank}")


def _second_backward(backend):
    # A second backward over one forward (retain_graph) reads the running statistics BatchNorm
    # saved: rank 0's arrive at the next forward, not at the synchronisation between the two.
    model = HybridShardedModel(batch_norm_model(), backend, dims=ParallelDims(dp=2))
    x, y = own_slice(batches(1)[0], model.groups.dp_index)
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    model.synchronize_gradients()
    loss.backward()
    model.synchronize_gradients()
    model.eval()
    with torch.no_grad():
        return model(PROBE), model.gather_full_parameters()


def test_a_second_backward_over_one_forward_still_reads_what_its_forward_saved():
    results = spawn(_second_backward, 2, timeout=60)
    expected = single_process_eval(results[0][1])
    for out, _ in results:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
