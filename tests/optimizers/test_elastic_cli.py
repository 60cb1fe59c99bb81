"""``distframe train --optimizer elastic`` when every worker that held the newest commit fails:
the command stops with one line naming the lost commit (exit status 1), not a traceback and not
a run that trains again from step 0."""
import os
import sysconfig
from pathlib import Path

import torch

from distframe import train_elastic
from distframe.cli import main
from distframe.optimizers.elastic_demo import DemoWorkerFailure

TINY = ("--preset", "tiny", "--seq-len", "32", "--segment-lengths", "8,16,32", "--lr", "1e-2",
        "--warmup-steps", "3", "--eval-batches", "2", "--eval-every", "0")


def _corpus(tmp_path: Path) -> str:
    root = sysconfig.get_paths()["stdlib"]
    path = tmp_path / "corpus.txt"
    with open(path, "wb") as out:
        for name in sorted(os.listdir(root)):
            full = Path(root, name)
            if name.endswith(".py") and 4000 < full.stat().st_size < 20000 and out.tell() < 150_000:
                out.write(full.read_bytes())
    return str(path)


def test_losing_every_holder_of_the_commit_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """World 2 grows to 4 after step 2; workers 0 and 1 die while the group of 4 builds its
    model, before the joiners receive the commit of step 2, and no checkpoint holds step 2."""
    build = train_elastic.build_model_and_optimizer

    def failing_build(module, backend, config, *, member, **kwargs):
        if backend.world_size == 4 and member.worker_id in (0, 1):
            raise DemoWorkerFailure(f"worker {member.worker_id} dies while joining the group of 4")
        return build(module, backend, config, member=member, **kwargs)
    monkeypatch.setattr(train_elastic, "build_model_and_optimizer", failing_build)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        status = main(["train", *TINY, "--data", _corpus(tmp_path), "--out", str(tmp_path / "out"),
                       "--world-size", "2", "--batch-size", "4", "--steps", "4", "--optimizer", "elastic",
                       "--elastic-schedule", "2:4", "--checkpoint-every", "0"])
    finally:
        torch.set_num_threads(previous)
    err = capsys.readouterr().err
    assert status == 1
    lines = [line for line in err.splitlines() if line.startswith("distframe: error")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "ElasticOptimizer: no worker of this group holds the commit of step 2" in lines[0]
    assert "steps 1 to 2" in lines[0]
    assert err.count("restored from") == 1  # only the first group went on (from step 0)
