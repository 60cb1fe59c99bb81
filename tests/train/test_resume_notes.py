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
