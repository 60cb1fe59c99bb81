"""Shared pieces of the ``distframe train`` tests: a small real-text corpus and a runner that
calls ``main([...])`` in this process and returns what the run left in OUT."""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from distframe.cli import main

# A tiny float64 model on short sequences: 30 steps take about a second per strategy.
TINY = ("--preset", "tiny", "--seq-len", "32", "--segment-lengths", "8,16,32",
        "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "3", "--eval-batches", "2")


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> str:
    """About 300 KB of real text: mid-sized standard-library modules, concatenated (the last
    5%, the validation split, is ordinary code too)."""
    root = sysconfig.get_paths()["stdlib"]
    path = tmp_path_factory.mktemp("corpus") / "stdlib_sample.txt"
    with open(path, "wb") as out:
        for name in sorted(os.listdir(root)):
            full = Path(root, name)
            if name.endswith(".py") and 4000 < full.stat().st_size < 20000 and out.tell() < 300_000:
                out.write(full.read_bytes())
    return str(path)


def read_metrics(out: str | Path) -> list[dict]:
    with open(Path(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def step_losses(metrics: list[dict]) -> list[tuple]:
    return [(m["step"], m["train_loss"], m["val_loss"]) for m in metrics]


def interrupted_copy(run: Path, copy: Path, keep_step: int) -> Path:
    """OUT as if the run had stopped right after the checkpoint of ``keep_step``."""
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > keep_step:
            shutil.rmtree(ckpt)
    return copy


def train(out: str | Path, corpus: str, *flags: str) -> list[dict]:
    """Runs ``distframe train`` with the tiny settings (flags override them) and returns the
    metrics it logged; fails the test unless it exits 0."""
    status = main(["train", *TINY, "--data", corpus, "--out", str(out), *flags])
    assert status == 0
    return read_metrics(out)


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    """Tiny models run fastest on one thread each, and CI machines are often shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
