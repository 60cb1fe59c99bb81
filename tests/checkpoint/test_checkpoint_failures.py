"""A checkpoint load or save that fails on some ranks only is raised on every rank, at once and
naming the failed ranks and why, not left for the healthy ranks to find at their next collective's
timeout; a failed save leaves the previous checkpoint loadable."""
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from distframe import checkpoint
from distframe.checkpoint import CheckpointError
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import SEED_LOCK, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

SHARD_1 = "shard-00001-of-00002.safetensors"


def _trained(backend, strategy="zero2", seed=0):
    model = STRATEGIES[strategy][0](build_model(seed=seed), backend)
    opt = STRATEGIES[strategy][1](model, torch.optim.Adam, lr=1e-2)
    batch = global_batches(1, 12)[0]
    model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
    return model, opt


def _save(backend, path, strategy="zero2", seed=0):
    model, opt = _trained(backend, strategy, seed)
    checkpoint.save(path, model, opt, step=1)
    return model.gather_full_parameters()


def _outcome(backend, action):
    """``(type, message)`` of what ``action()`` raised on this rank, or None; then one all_reduce,
    which completes only if every rank left ``action`` at the same point of the collective order."""
    try:
        action()
        outcome = None
    except Exception as exc:  # noqa: BLE001 - returned to the test to inspect
        outcome = (type(exc), str(exc))
    together = torch.ones(1)
    backend.all_reduce(together)
    return outcome, int(together)


def _load_per_rank_copy(backend, paths, strategy="zero2"):
    """Each rank loads its own copy of one checkpoint (as from node-local disks)."""
    model = STRATEGIES[strategy][0](build_model(seed=5), backend)
    opt = STRATEGIES[strategy][1](model, torch.optim.Adam, lr=1e-2)
    return _outcome(backend, lambda: checkpoint.load(paths[backend.rank], model, opt))


def _damage(path: Path, how: str) -> str:
    """Damages rank 1's shard file at ``path``; returns what the error must say."""
    shard = path / SHARD_1
    if how == "missing":
        shard.unlink()
        return "is missing"
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(bytes(data[:-10]))
        return "truncated"
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    return "sha256"


def _copies(tmp_path, world=2, strategy="zero2"):
    good = tmp_path / "node0" / "ckpt"
    spawn(lambda b: _save(b, good, strategy), world)
    bad = tmp_path / "node1" / "ckpt"
    shutil.copytree(good, bad)
    return good, bad


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupt"])
@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_a_load_that_fails_on_one_rank_raises_on_every_rank(tmp_path, how, strategy):
    # ZeRO-2's load ends in an all_gather that rank 0 entered alone; DDP's has no collective, so
    # rank 0 went on as if nothing had happened.
    good, bad = _copies(tmp_path, strategy=strategy)
    reason = _damage(bad, how)
    for rank, (outcome, together) in enumerate(spawn(lambda b: _load_per_rank_copy(b, [good, bad], strategy),
                                                     2, timeout=20)):
        assert together == 2
        assert outcome is not None, f"rank {rank} did not raise"
        kind, message = outcome
        assert kind is CheckpointError, message
        assert "failed on rank 1 of 2" in message and reason in message and SHARD_1 in message


def test_ranks_that_read_different_checkpoints_raise_on_every_rank(tmp_path):
    # Node-local copies of "the latest checkpoint" that are not the same one: each rank loaded
    # its own without complaint, and the replicas trained on from different states.
    newer, older = tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"

    def save_twice(backend):
        model, opt = _trained(backend)
        checkpoint.save(older, model, opt, step=1)
        model.train_step(rank_slice(global_batches(2, 12)[1], backend.rank, 2), loss_fn, opt)
        checkpoint.save(newer, model, opt, step=2)
    spawn(save_twice, 2)
    for outcome, together in spawn(lambda b: _load_per_rank_copy(b, [newer, older]), 2, timeout=20):
        assert together == 2 and outcome is not None
        kind, message = outcome
        assert kind is CheckpointError and "different checkpoints" in message
        assert "step 2 on rank 0" in message and "step 1 on rank 1" in message


class _Scale(nn.Module):
    """Multiplies by the sum of a buffer of ``width`` elements (a layer with state of its own)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(width, dtype=torch.float64))

    def forward(self, x):
        return x * self.scale.sum()


def _staged(width: int) -> nn.Sequential:
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2), _Scale(width)).double()


def test_a_shape_check_that_fails_on_one_pipeline_stage_raises_on_every_rank(tmp_path):
    # The buffer lives on the last stage: only rank 1 checks its shape.
    path = tmp_path / "ckpt"

    def run(backend):
        dims = ParallelDims(pp=2)
        checkpoint.save(path, HybridShardedModel(_staged(1), backend, dims=dims, num_microbatches=2))
        other = HybridShardedModel(_staged(3), backend, dims=dims, num_microbatches=2)
        return _outcome(backend, lambda: checkpoint.load(path, other))
    for outcome, together in spawn(run, 2, timeout=20):
        assert together == 2 and outcome is not None
        kind, message = outcome
        assert kind is CheckpointError and "failed on rank 1 of 2" in message and "'3.scale'" in message


def test_a_setting_to_change_stays_a_config_error_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path), 2)

    def run(backend):
        model = STRATEGIES["zero2"][0](build_model(), backend)
        other = STRATEGIES["zero2"][0](build_model(), backend)
        wrong = STRATEGIES["zero2"][1](other, torch.optim.Adam, lr=1e-2)  # built for another model
        return _outcome(backend, lambda: checkpoint.load(path, model, wrong))
    for outcome, together in spawn(run, 2, timeout=20):
        assert together == 2
        kind, message = outcome
        assert kind is ConfigError and "failed on ranks [0, 1] of 2" in message
        assert "was built for a different model" in message


def _fail_writes_of(monkeypatch, name: str, error: Exception) -> None:
    real = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if name in str(filename):
            raise error
        return real(tensors, filename, *args, **kwargs)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _assert_loads_as(path, saved):
    for name, value in spawn(lambda b: _load_params(b, path), 3)[0].items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def _load_params(backend, path):
    model = STRATEGIES["ddp"][0](build_model(seed=5), backend)
    checkpoint.load(path, model)
    return model.gather_full_parameters()


def _assert_raised_everywhere(results, *parts: str, kind=CheckpointError) -> None:
    """Every rank raised a ``kind`` saying ``parts``, and then still met its peers."""
    for outcome, together in results:
        assert together == 2 and outcome is not None
        raised, message = outcome
        assert raised is kind and all(p in message for p in parts), message


@pytest.mark.parametrize("same_path", [False, True])
def test_a_write_that_fails_on_one_rank_raises_on_every_rank_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch, same_path):
    first = tmp_path / "step-1"
    saved = spawn(lambda b: _save(b, first), 2)[0]
    _fail_writes_of(monkeypatch, "shard-00001", OSError(28, "No space left on device"))
    second = first if same_path else tmp_path / "step-2"
    results = spawn(lambda b: _outcome(b, lambda: _save(b, second, seed=3)), 2, timeout=20)
    monkeypatch.undo()
    # A full disk is the place to change (ConfigError: distframe train exits 2 saying so).
    _assert_raised_everywhere(results, "failed on rank 1 of 2", "No space left on device", "free space there",
                              kind=ConfigError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # nothing half-written stays
    assert checkpoint.latest_step(tmp_path) == (first, 1)
    _assert_loads_as(first, saved)


def test_a_commit_that_fails_on_rank_0_raises_on_every_rank_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    # Rank 0 moves the old checkpoint aside, then renames the new one into place: that rename
    # fails here, and the old one must be back under its name.
    path = tmp_path / "ckpt"
    saved = spawn(lambda b: _save(b, path), 2)[0]
    real = Path.rename

    def rename(self, target):
        if self.name.startswith(".ckpt.tmp-"):
            raise PermissionError(13, "Permission denied", str(target))
        return real(self, target)
    monkeypatch.setattr(Path, "rename", rename)
    results = spawn(lambda b: _outcome(b, lambda: _save(b, path, seed=3)), 2, timeout=20)
    monkeypatch.undo()
    _assert_raised_everywhere(results, "failed on rank 0 of 2", "Permission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_loads_as(path, saved)


# ---- the same over gloo processes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_pool():
    from distframe._process_launch import ProcessPool

    with ProcessPool(2, "gloo", timeout=30) as pool:
        yield pool


def _gloo_save(backend, path, fail_on_rank=None):
    model, opt = _trained(backend)
    if backend.rank != fail_on_rank:
        return _outcome(backend, lambda: checkpoint.save(path, model, opt, step=2))
    real = safetensors.torch.save_file

    def save_file(*args, **kwargs):
        raise OSError(28, "No space left on device")
    safetensors.torch.save_file = save_file  # this rank's process only
    try:
        return _outcome(backend, lambda: checkpoint.save(path, model, opt, step=2))
    finally:
        safetensors.torch.save_file = real


@pytest.mark.gloo
def test_one_ranks_failures_are_raised_on_every_rank_over_gloo(gloo_pool, tmp_path):
    good, bad = tmp_path / "node0" / "step-2", tmp_path / "node1" / "step-2"
    assert gloo_pool.run(_gloo_save, good) == [(None, 2), (None, 2)]
    shutil.copytree(good, bad)
    _damage(bad, "corrupt")
    for outcome, together in gloo_pool.run(_load_per_rank_copy, [good, bad]):
        assert together == 2 and outcome is not None
        assert outcome[0] is CheckpointError and "failed on rank 1 of 2" in outcome[1]
    for outcome, together in gloo_pool.run(_gloo_save, good, fail_on_rank=1):
        assert together == 2 and outcome is not None
        assert outcome[0] is ConfigError and "No space left on device" in outcome[1]
    assert [p.name for p in good.parent.iterdir()] == ["step-2"]
    assert checkpoint.latest_step(good.parent) == (good, 2)
