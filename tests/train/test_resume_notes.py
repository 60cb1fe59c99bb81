"""What a resumed run tells the user: only notes that apply to it."""
from __future__ import annotations

import torch

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


def test_another_compressor_on_resume_drops_the_old_ones_settings(tmp_path, corpus_file, capsys):
    """--resume with another --compressor was refused for the old compressor's setting, which the
    user never passed ("--topk-ratio applies to --compressor topk, not int8; drop --topk-ratio"):
    it came from the saved run. The old compressor's settings go with it, as an old optimizer's do."""
    train(tmp_path, corpus_file, "--steps", "1", "--world-size", "2", "--optimizer", "compressed",
          "--compressor", "topk", "--topk-ratio", "0.1")
    resumed = train(tmp_path, corpus_file, "--resume", "--steps", "2", "--compressor", "int8")
    assert [r["step"] for r in resumed] == [1, 2]
    assert "topk" not in capsys.readouterr().err


def test_a_text_corpus_on_resume_drops_the_token_files_dtype(tmp_path, corpus_file):
    """A run on a uint16 .bin token file, resumed with --data naming a text file, was told to drop
    --token-dtype, a flag the user never passed: the saved run's dtype belongs to its token file."""
    tokens = tmp_path / "tokens.bin"
    with open(corpus_file, "rb") as f:  # byte values, 255 among them: text's vocabulary of 256
        values = [*f.read(), *range(256)]
    torch.tensor(values, dtype=torch.int32).to(torch.uint16).numpy().tofile(tokens)
    out = tmp_path / "out"
    train(out, str(tokens), "--steps", "1", "--world-size", "1", "--token-dtype", "uint16")
    resumed = train(out, corpus_file, "--resume", "--steps", "2")
    assert [r["step"] for r in resumed] == [1, 2]


def test_an_elastic_resume_names_the_world_its_schedule_reached(tmp_path, corpus_file, capsys):
    """An elastic run resumes with the world its --elastic-schedule had reached by the saved step,
    not --world-size: the note compared the checkpoint's world (4) with the default 2 and advised
    --world-size 4 for a run that continued on 4."""
    flags = ("--optimizer", "elastic", "--elastic-schedule", "1:4", "--checkpoint-every", "2")
    train(tmp_path, corpus_file, "--steps", "2", "--world-size", "2", *flags)
    capsys.readouterr()
    resumed = train(tmp_path, corpus_file, "--resume", "--steps", "3")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert "saved at world size" not in capsys.readouterr().err
