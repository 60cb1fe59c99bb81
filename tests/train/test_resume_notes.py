"""What a resumed run tells the user: only notes that apply to it."""
from __future__ import annotations

from tests.train.conftest import train


def test_no_dropout_note_when_dropout_is_off(tmp_path, corpus_file, capsys):
    """A tensor-parallel model has dropout generators even at --dropout 0: resumed under another
    layout it printed "dropout masks from step 2 on are new ..." though no mask is drawn."""
    train(tmp_path, corpus_file, "--steps", "1", "--world-size", "1", "--eval-batches", "1")
    capsys.readouterr()
    resumed = train(tmp_path, corpus_file, "--resume", "--steps", "2", "--strategy", "tensor",
                    "--world-size", "2", "--eval-batches", "1")
    assert [r["step"] for r in resumed] == [1, 2]
    assert "dropout" not in capsys.readouterr().err


def test_a_resume_at_another_world_size_than_saved_says_so(tmp_path, corpus_file, capsys):
    """--resume takes the saved run's settings but not its world size (a launch setting): left
    out, the run continues on the default 2 ranks, which with a lossy --compressor (or dropout)
    no longer equals the uninterrupted run; one line says so and how to keep the saved one."""
    flags = ("--eval-batches", "1", "--optimizer", "compressed", "--compressor", "topk")
    train(tmp_path, corpus_file, "--steps", "1", "--world-size", "4", *flags)
    capsys.readouterr()
    train(tmp_path, corpus_file, "--resume", "--steps", "2")
    lines = [line for line in capsys.readouterr().err.splitlines() if "world size" in line]
    assert len(lines) == 1 and "saved at world size 4" in lines[0] and "2 ranks" in lines[0]
    assert "--world-size 4" in lines[0]
    for given in ("4", "2"):  # a world size given on the command line is the user's choice
        train(tmp_path, corpus_file, "--resume", "--steps", "3" if given == "4" else "4",
              "--world-size", given)
        assert "saved at world size" not in capsys.readouterr().err
    train(tmp_path, corpus_file, "--resume", "--steps", "5")  # saved at 2 (the last resume's)
    assert "saved at world size" not in capsys.readouterr().err
