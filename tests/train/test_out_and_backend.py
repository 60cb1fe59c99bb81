"""``--out`` that cannot be written and the engine ``--backend auto`` picks under a launcher:
found before any rank trains, in one line that says what to change."""
from __future__ import annotations

import os

import pytest

from tests.train.conftest import TINY
from tests.train.test_bad_input import _fails_with


@pytest.mark.parametrize("root", ["/proc", "/sys"])
def test_out_that_cannot_be_written(capsys, corpus_file, root):
    """Kernel file systems refuse new directories even to root (ENOENT, EPERM): the run used to
    end in an OSError's traceback from inside a rank (or a bare "[Errno 2] ..." line)."""
    if not os.path.isdir(root):
        pytest.skip(f"no {root} here")
    out = os.path.join(root, "distframe-test-run")
    for world in ("1", "2"):
        _fails_with(capsys, ["train", *TINY, "--data", corpus_file, "--out", out, "--steps", "1",
                             "--world-size", world], f"--out {out}", "cannot write there",
                    "directory you can write to")
    assert not os.path.exists(out)


class _Started(Exception):
    pass


@pytest.mark.parametrize(("gpus", "local_ranks", "expected"), [(1, 2, "gloo"), (2, 2, "nccl"),
                                                                (0, 1, "gloo")])
def test_auto_backend_under_torchrun(monkeypatch, tmp_path, gpus, local_ranks, expected):
    """``torchrun --nproc-per-node 2 -m distframe train`` on a one-GPU machine picked NCCL (CUDA
    is there), which refuses two ranks on one GPU; it now picks what init_backend("auto") picks."""
    import torch

    from distframe import train
    from distframe.backends import torch_dist
    from distframe.train_config import TrainConfig
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"RANK": "0", "WORLD_SIZE": str(local_ranks), "MASTER_ADDR": "127.0.0.1",
                       "LOCAL_WORLD_SIZE": str(local_ranks)}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch_dist, "visible_gpus", lambda: gpus)
    started = []

    def init_backend(name, **kw):
        started.append(name)
        raise _Started
    monkeypatch.setattr(train, "init_backend", init_backend)
    with pytest.raises(_Started):
        train.run(TrainConfig(out=str(tmp_path)))
    assert started == [expected]


def test_token_dtype_of_a_file_not_named_bin(capsys, tmp_path):
    tokens = tmp_path / "tokens.u16"
    tokens.write_bytes(bytes(range(256)) * 8)
    _fails_with(capsys, ["train", *TINY, "--data", str(tokens), "--token-dtype", "uint16",
                         "--out", str(tmp_path / "run")],
                "--token-dtype uint16", f"--data is {tokens}", "end in .bin")
