"""Sharded checkpoints: round trips across world sizes and strategies, atomicity, corruption."""
import safetensors.torch
import pytest
import torch

from distframe import checkpoint
from distframe.checkpoint import CheckpointError
from distframe.launch import spawn
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

STEPS_PER_PHASE = 2


def _phase(backend, strategy, batches, load_from, save_to, first_step):
    model_cls, opt_cls = STRATEGIES[strategy]
    # Weights other than the checkpoint's, so a load that misses anything shows.
    model = model_cls(build_model(seed=0 if load_from is None else 99), backend, **SETTINGS[strategy])
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    loaded = None
    if load_from is not None:
        loaded = checkpoint.load(load_from, model, opt)["step"]
    for batch in batches[first_step:first_step + STEPS_PER_PHASE]:
        model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
    checkpoint.save(save_to, model, opt, step=first_step + STEPS_PER_PHASE)
    return loaded, model.gather_full_parameters()


@pytest.mark.parametrize("chain", [
    [("zero3", 2), ("ddp", 3), ("zero1", 4), ("fsdp", 1)],
    [("ddp", 2), ("zero2", 3), ("zero3", 4), ("zero1", 1)],
    [("fsdp", 4), ("ddp", 3), ("zero2", 2)],
])
def test_round_trip_across_world_sizes_and_strategies(tmp_path, chain):
    batches = global_batches(STEPS_PER_PHASE * len(chain), 12)
    reference = reference_run(batches)
    previous = None
    for k, (strategy, world) in enumerate(chain):
        target = tmp_path / f"step-{k}"
        results = spawn(lambda b: _phase(b, strategy, batches, previous, target, k * STEPS_PER_PHASE),
                        world, timeout=60)
        for loaded, params in results:
            assert loaded == (None if previous is None else k * STEPS_PER_PHASE)
            for name, value in reference[(k + 1) * STEPS_PER_PHASE - 1].items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
        consolidated = checkpoint.consolidate(target)
        for name, value in results[0][1].items():
            torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0)
        previous = target


def _save(backend, path, fail_on_rank=None, monkeypatch=None):
    model = STRATEGIES["zero2"][0](build_model(), backend)
    opt = STRATEGIES["zero2"][1](model, torch.optim.Adam, lr=1e-2)
    batch = global_batches(1, 12)[0]
    model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
    checkpoint.save(path, model, opt, step=1)
    return model.gather_full_parameters()


def _load(backend, path):
    model = STRATEGIES["ddp"][0](build_model(seed=5), backend)
    checkpoint.load(path, model)
    return model.gather_full_parameters()


@pytest.mark.parametrize("same_path", [False, True])
def test_a_save_killed_midway_leaves_the_last_checkpoint_loadable(tmp_path, monkeypatch, same_path):
    first = tmp_path / "ckpt"
    saved = spawn(lambda b: _save(b, first), 2)[0]
    real = safetensors.torch.save_file

    def dies_on_rank_1(tensors, filename, *args, **kwargs):
        if "shard-00001" in str(filename):
            raise KeyboardInterrupt("killed while writing")
        return real(tensors, filename, *args, **kwargs)
    monkeypatch.setattr(safetensors.torch, "save_file", dies_on_rank_1)
    second = first if same_path else tmp_path / "ckpt-2"
    with pytest.raises(KeyboardInterrupt):
        spawn(lambda b: _save(b, second), 2, timeout=20)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    if not same_path:
        assert not second.exists()
    for name, value in spawn(lambda b: _load(b, first), 3)[0].items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_corrupt_or_incomplete_checkpoints_raise_naming_the_file(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path), 2)
    shard = path / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="shard-00001-of-00002.safetensors"):
        spawn(lambda b: _load(b, path), 2)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.consolidate(path)
    (path / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="metadata.json"):
        checkpoint.consolidate(path)


def test_loading_into_a_different_model_names_the_parameter(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: _save(b, path), 1)

    def load_other(backend):
        other = torch.nn.Sequential(torch.nn.Linear(6, 5)).double()
        checkpoint.load(path, STRATEGIES["ddp"][0](other, backend))
    with pytest.raises(CheckpointError, match="'0.weight'"):
        spawn(load_other, 1)
