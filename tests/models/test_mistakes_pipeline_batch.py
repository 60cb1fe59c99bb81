"""Ranks of one pipeline given different slices of the batch (the DDP / DistributedSampler habit),
where every rank of a pipeline passes the same one: the last stage paired rank 0's inputs with its
own targets, silently (1.3263, neither slice's loss), or with slices of different sizes gave only
torch's broadcasting warning and a wrong loss. Refused with a ConfigError on every rank: sizes
always, contents of same-size slices under ``debug=True``."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from distframe.errors import ConfigError, RankFailedError
from distframe.launch import spawn
from distframe.models.pipeline import PipelineParallelModel
from tests.models.common import build_model, global_batches, rank_slice


def _attempt(backend, rows, schedule="1f1b", microbatches=2, loss_fn=F.mse_loss):
    """Every rank's outcome of one step on its ``rows(rank)`` of the global batch: the loss, or the
    type and message of the ConfigError or RankFailedError it raised."""
    model = PipelineParallelModel(build_model(), backend, num_microbatches=microbatches, schedule=schedule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batches(1, 8)[0]
    try:
        return model.train_step(rows(backend.rank, x, y), loss_fn, opt)
    except (ConfigError, RankFailedError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _own_slice(rank, x, y):
    return rank_slice((x, y), rank, 2)


def _first_whole_last_two_rows(rank, x, y):
    return (x, y) if rank == 0 else (x[2:4], y[2:4])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_slices_of_different_sizes_are_refused_on_every_rank(schedule):
    for message in spawn(functools.partial(_attempt, rows=_first_whole_last_two_rows, schedule=schedule), 2,
                         timeout=20):
        assert isinstance(message, str), message
        assert message.startswith("ConfigError") and "8 rows" in message and "2 rows" in message
        assert "same batch" in message


def test_each_rank_its_own_half_is_refused_under_debug():
    for message in spawn(functools.partial(_attempt, rows=_own_slice), 2, timeout=20, debug=True):
        assert isinstance(message, str), message
        assert message.startswith("ConfigError") and "different inputs" in message
        assert "same batch" in message


def test_the_same_batch_trains_under_debug_as_one_process():
    x, y = global_batches(1, 8)[0]
    reference = build_model()
    expected = F.mse_loss(reference(x), y).item()
    for loss in spawn(functools.partial(_attempt, rows=lambda rank, x, y: (x, y)), 2, timeout=20, debug=True):
        assert loss == pytest.approx(expected, rel=1e-12)


def test_only_the_tensors_a_stage_uses_may_be_given_under_debug():
    x, y = global_batches(1, 8)[0]
    expected = F.mse_loss(build_model()(x), y).item()
    rows = lambda rank, x, y: (x, None) if rank == 0 else (None, y)  # noqa: E731
    for loss in spawn(functools.partial(_attempt, rows=rows), 2, timeout=20, debug=True):
        assert loss == pytest.approx(expected, rel=1e-12)


def test_a_batch_the_first_stage_cannot_split_stops_every_rank():
    # 7 rows into 2 micro-batches: rank 0 says why; the last rank, which waited for rank 0's
    # activations (CollectiveTimeoutError once rank 0 had left), stops at once, naming it.
    rows = lambda rank, x, y: (x[:7], y[:7]) if rank == 0 else (x, y)  # noqa: E731
    messages = spawn(functools.partial(_attempt, rows=rows), 2, timeout=20)
    assert messages[0].startswith("ConfigError") and "not divisible by num_microbatches=2" in messages[0]
    assert messages[1].startswith("RankFailedError") and "pipeline rank 0 refused its inputs" in messages[1]


def _flat_loss(out, targets):
    return F.mse_loss(out.reshape(-1), targets)


def test_targets_flattened_to_a_whole_multiple_of_the_rows_still_train():
    # (8, k) targets given as 8k rows: micro-batches still pair row for row, as before the check.
    x, y = global_batches(1, 8)[0]
    expected = F.mse_loss(build_model()(x), y).item()
    rows = lambda rank, x, y: (x, y.reshape(-1))  # noqa: E731
    for loss in spawn(functools.partial(_attempt, rows=rows, loss_fn=_flat_loss), 2, timeout=20):
        assert loss == pytest.approx(expected, rel=1e-12)
