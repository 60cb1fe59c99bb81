"""End to end on the in-memory engine: every data-parallel strategy learns, they agree with each
other (float64, same seed), the outputs are as documented, and a resumed run equals an
uninterrupted one, also at another world size and strategy."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from distframe.cli import main
from tests.train.conftest import train

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
STEPS = 30


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    """``runs[strategy]``: (OUT, metrics) of that strategy trained 30 steps at world 2 in
    float64 with checkpoints every 10 steps; each run happens once, when first asked for."""
    return _Runs(tmp_path_factory.mktemp("runs"), corpus_file)


class _Runs:
    def __init__(self, root: Path, corpus: str) -> None:
        self.root, self.corpus, self.done = root, corpus, {}

    def __getitem__(self, strategy: str) -> tuple[Path, list[dict]]:
        if strategy not in self.done:
            path = self.root / strategy
            try:
                self.done[strategy] = (path, train(
                    path, self.corpus, "--strategy", strategy, "--world-size", "2",
                    "--dtype", "float64", "--steps", str(STEPS), "--eval-every", "10",
                    "--checkpoint-every", "10"))
            except Exception as exc:  # noqa: BLE001 - every test that needs this run fails
                self.done[strategy] = exc
        if isinstance(self.done[strategy], Exception):
            raise self.done[strategy]
        return self.done[strategy]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_validation_loss_falls(runs, strategy):
    _, metrics = runs[strategy]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    val = [m["val_loss"] for m in metrics if m["val_loss"] is not None]
    assert len(val) == 3
    assert val[-1] < val[0] - 0.1
    assert val[-1] < math.log(256) - 2  # well below a uniform guess over bytes


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_same_seed_same_curve_as_ddp(runs, strategy):
    ddp, other = runs["ddp"][1], runs[strategy][1]
    for a, b in zip(ddp, other):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-8)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-8)


def test_outputs(runs):
    path, metrics = runs["ddp"]
    assert set(metrics[0]) == {"step", "train_loss", "val_loss", "tokens_per_s",
                               "peak_memory_bytes", "wall_s"}
    assert all(m["tokens_per_s"] > 0 and m["peak_memory_bytes"] > 0 for m in metrics)
    assert [m["wall_s"] for m in metrics] == sorted(m["wall_s"] for m in metrics)
    config = json.loads((path / "config.json").read_text())
    assert config["train"]["strategy"] == "ddp" and config["train"]["world_size"] == 2
    assert config["model"]["seq_len"] == 32 and config["model"]["segment_lengths"] == [8, 16, 32]
    steps = sorted(p.name for p in (path / "checkpoints").iterdir())
    assert steps == ["step-10", "step-20", "step-30"]
    for step in steps:
        assert (path / "checkpoints" / step / "metadata.json").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (path / "loss.png").exists()
    else:
        assert (path / "loss.png").stat().st_size > 0


def test_summary_line_and_plot_hint(tmp_path, corpus_file, capsys):
    train(tmp_path, corpus_file, "--steps", "2", "--world-size", "1", "--eval-every", "0")
    captured = capsys.readouterr()
    summary = [line for line in captured.out.splitlines() if line.startswith("distframe train:")]
    assert len(summary) == 1 and "step 2/2" in summary[0] and "validation loss" in summary[0]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install 'distframe[plot]'" in captured.err


def _interrupted_copy(run: Path, tmp_path: Path, keep_step: int) -> Path:
    """OUT as if the run had stopped right after the checkpoint of ``keep_step``."""
    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > keep_step:
            shutil.rmtree(ckpt)
    return copy


def test_resume_equals_uninterrupted(runs, tmp_path, corpus_file):
    run, full = runs["zero2"]
    copy = _interrupted_copy(run, tmp_path, keep_step=20)
    resumed = train(copy, corpus_file, "--resume")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full, resumed):  # float64, same world and strategy: exactly equal
        assert (a["train_loss"], a["val_loss"]) == (b["train_loss"], b["val_loss"])


@pytest.mark.parametrize(("saved", "strategy", "world_size"),
                         [("zero2", "fsdp", "4"), ("fsdp", "ddp", "1")])
def test_resume_at_another_world_size_and_strategy(runs, tmp_path, corpus_file, saved, strategy,
                                                   world_size):
    run, full = runs[saved]
    copy = _interrupted_copy(run, tmp_path, keep_step=10)
    resumed = train(copy, corpus_file, "--resume", "--strategy", strategy,
                    "--world-size", world_size)
    config = json.loads((copy / "config.json").read_text())["train"]
    assert (config["strategy"], config["world_size"], config["steps"]) == (strategy, int(world_size), STEPS)
    for a, b in zip(full, resumed):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-8)


def test_resume_without_checkpoint_is_bad_input(tmp_path, corpus_file, capsys):
    status = main(["train", "--preset", "tiny", "--data", corpus_file, "--out", str(tmp_path),
                   "--resume"])
    assert status == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_generate_from_checkpoint(runs, capsys):
    path, _ = runs["fsdp"]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(path / "checkpoints" / "step-30"),
                 "--prompt", "def ", "--tokens", "40"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 20
    # a run directory means its latest checkpoint; greedy sampling is deterministic
    greedy = ["generate", "--checkpoint", str(path), "--tokens", "10", "--temperature", "0"]
    assert main(greedy) == 0
    first = capsys.readouterr().out
    assert main(greedy) == 0
    assert capsys.readouterr().out == first


def test_resume_after_a_save_that_died_between_its_renames(tmp_path, corpus_file, monkeypatch):
    """A save over an existing step-N moves it aside (``.step-N.old-*``), then renames the new
    one into place: dying in between leaves step N only under the aside name. Discovery finds
    it there (--resume continues from step N, not an older step), and the next save cleans up."""
    from distframe import train_checkpoint
    from distframe.checkpoint import io
    from distframe.optimizers import elastic
    before = train(tmp_path, corpus_file, "--steps", "4", "--checkpoint-every", "2",
                   "--world-size", "1", "--eval-every", "0")
    root = tmp_path / "checkpoints"
    tmp = root / ".step-4.tmp-00000000abcd"  # a re-save of step 4, complete but not yet renamed
    shutil.copytree(root / "step-4", tmp)
    # by a writer that then died: its pid is now another process's (this one, started earlier)
    io.temporary.write_writer_record(tmp, 0)
    record = json.loads((tmp / "writer-00000.json").read_text())
    (tmp / "writer-00000.json").write_text(json.dumps({**record, "start_time": -1}))
    real_rename, calls = os.rename, []

    def dies_at_the_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", dies_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        io._rename_into_place(tmp, root / "step-4")
    monkeypatch.setattr(os, "rename", real_rename)
    aside = root / ".step-4.old-00000000abcd"
    assert not (root / "step-4").exists() and (aside / "metadata.json").exists()
    assert train_checkpoint.latest_checkpoint(str(tmp_path)) == (str(aside), 4)
    assert elastic.latest_checkpoint(root) == aside
    resumed = train(tmp_path, corpus_file, "--resume", "--steps", "5", "--eval-every", "0")
    assert resumed[:4] == before and [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    later = root / ".step-4.tmp-0000000000ef"
    shutil.copytree(root / "step-5", later)
    io._rename_into_place(later, root / "step-4")  # a later save of step 4 that completes
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4", "step-5"]


def test_resume_after_a_crash_mid_metrics_write(tmp_path, corpus_file, capsys):
    """A crash while a metrics record is written leaves a last line cut short (no newline after
    it): --resume drops it, where it used to stop on a JSON error; a damaged line before the last
    is bad input naming the file and line."""
    before = train(tmp_path, corpus_file, "--steps", "2", "--checkpoint-every", "2",
                   "--world-size", "1", "--eval-every", "0")
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a", encoding="utf-8") as f:
        f.write('{"step": 3, "train_lo')
    resumed = train(tmp_path, corpus_file, "--resume", "--steps", "3", "--eval-every", "0")
    assert resumed[:2] == before and [r["step"] for r in resumed] == [1, 2, 3]
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path), "--data", corpus_file, "--resume", "--steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl line 2" in err and "\n" not in err


@pytest.mark.parametrize("rank1_sees", ["none", "step-2"])
def test_resume_where_one_rank_sees_other_checkpoints(tmp_path, corpus_file, capsys, monkeypatch,
                                                      rank1_sees):
    """Node-local OUT directories out of step: rank 1 finds no checkpoint, or an older one.
    Every rank says so at once, naming the ranks (one line), where rank 1 used to raise alone:
    in-memory ranks then stop with it, but a process engine's rank 0 waited in the load's
    collectives for the timeout."""
    import threading

    from distframe import train_checkpoint
    train(tmp_path, corpus_file, "--steps", "4", "--checkpoint-every", "2", "--world-size", "2",
          "--eval-every", "0")
    real = train_checkpoint.latest_checkpoint

    def node_local(out):
        found = real(out)
        if threading.current_thread().name != "distframe-rank1":
            return found
        return None if rank1_sees == "none" else (str(Path(out) / "checkpoints" / "step-2"), 2)
    monkeypatch.setattr(train_checkpoint, "latest_checkpoint", node_local)
    capsys.readouterr()
    status = main(["train", "--data", corpus_file, "--out", str(tmp_path), "--resume", "--steps", "6"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    rank1 = "none on rank 1" if rank1_sees == "none" else "step 2 on rank 1"
    assert status == 2 and "different latest checkpoints" in err, err
    assert "step 4 on rank 0" in err and rank1 in err, err
