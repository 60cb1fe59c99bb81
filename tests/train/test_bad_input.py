"""Bad input: exit status 2 and one line on stderr that says what to change, no traceback
(unless --debug); Ctrl-C exits 130 and leaves only complete checkpoints."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distframe.cli import main
from distframe.train_config import TrainConfig
from tests.train.conftest import TINY, train


def _fails_with(capsys, argv: list[str], *needles: str) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.mark.parametrize(("flags", "needles"), [
    (["--strategy", "bogus"], ["--strategy", "choose one of ddp"]),
    (["--backend", "pigeon"], ["--backend", "inmemory"]),
    (["--world-size", "3", "--batch-size", "8"], ["--world-size 3", "--batch-size 8"]),
    (["--seq-len", "32", "--segment-lengths", "8,16,64"], ["--segment-lengths", "--seq-len 32"]),
    (["--segment-lengths", "8,16", "--dilation-rates", "1,2,4"],
     ["--segment-lengths 8,16 and --dilation-rates 1,2,4 differ", "--dilation-rates 1,2"]),
    # The preset's three rates with two segment lengths: the message named internal fields
    (["--seq-len", "16", "--segment-lengths", "8,16"],
     ["--dilation-rates 1,2,4 (--preset tiny's)", "one dilation rate per segment length"]),
    (["--data", "/no/such/corpus.txt"], ["--data /no/such/corpus.txt"]),
    (["--steps", "0"], ["--steps"]),
    (["--steps", "many"], ["--steps", "invalid int"]),
    (["--strategyy", "ddp"], ["unrecognized arguments"]),
    (["--preset", "huge"], ["--preset", "tiny"]),
    (["--lr", "-1"], ["--lr"]),
    (["--lr", "nan"], ["--lr nan", "positive number"]),
    (["--lr", "inf"], ["--lr inf", "positive number"]),
    (["--weight-decay", "nan"], ["--weight-decay nan"]),
    (["--lr", "3.5e38"], ["--lr 3.5e+38", "up to 3.403e+38 (float32's largest)"]),
    (["--weight-decay", "1e39"], ["--weight-decay 1e+39", "or 0 up to 3.403e+38"]),
    (["--seed", str(2 ** 64)], ["--seed", "2**63"]),
    (["--dropout", "1"], ["--dropout 1.0", "0 <= P < 1"]),
    (["--dropout", "-0.1"], ["--dropout -0.1", "0 <= P < 1"]),
    (["--dropout", "nan"], ["--dropout nan", "0 <= P < 1"]),
    (["--dropout", "lots"], ["--dropout", "invalid float"]),
    # read as text, a token file not named .bin trained on its raw bytes without a word
    (["--token-dtype", "uint16"], ["--token-dtype uint16", ".bin", "default corpus"]),
    (["--dropout", "0.1", "--strategy", "hybrid", "--world-size", "2", "--cp", "2"],
     ["--dropout 0.1", "--cp 2", "--cp 1 or --dropout 0"]),
    (["--compile", "tensorrt"], ["--compile 'tensorrt' is unknown", "inductor, aot_eager, eager"]),
    # in-memory ranks are threads: refused before any rank starts, saying how to run it
    (["--compile"], ["--compile: in-memory ranks are threads", "--backend gloo", "--world-size 1"]),
    (["--compile", "--backend", "inmemory", "--world-size", "3", "--batch-size", "6"],
     ["start the 3 ranks as processes"]),
    (["--compile", "--optimizer", "elastic", "--elastic-schedule", "2:1"],
     ["--optimizer elastic", "drop --compile"]),
])
def test_bad_flags(capsys, tmp_path, flags, needles):
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), *flags], *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_nccl_without_gpu(capsys, tmp_path):
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), "--backend", "nccl"],
                "--backend nccl needs a CUDA GPU", "gloo")


def test_mpi_without_mpi4py(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now raises ImportError
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), "--backend", "mpi"],
                "mpi4py", "pip install")


@pytest.mark.parametrize("value", ["true", '"0.1"', "1.5"])
def test_dropout_in_a_config_file(capsys, tmp_path, value):
    config = tmp_path / "run.toml"
    config.write_text(f"dropout = {value}\n")
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), "--config", str(config)],
                "--dropout", "0 <= P < 1")


def test_config_file_errors(capsys, tmp_path):
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text('strategy = "ddp"\nlearning-rate = 0.1\n')
    _fails_with(capsys, ["train", "--config", str(bad_key)], "learning-rate")
    _fails_with(capsys, ["train", "--config", str(tmp_path / "missing.toml")], "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("strategy = \n")
    _fails_with(capsys, ["train", "--config", str(broken)], "not valid TOML")
    _fails_with(capsys, ["train", "--config", str(tmp_path)], f"--config {tmp_path}")
    quoted = tmp_path / "quoted.toml"
    quoted.write_text('resume = "false"\n')  # a string, which bool() would take for True
    _fails_with(capsys, ["train", "--config", str(quoted)], "--resume 'false'", "true or false")
    for value in ('["compressed"]', "{}"):  # unhashable: a traceback (TypeError) where one line is due
        listed = tmp_path / "listed.toml"
        listed.write_text(f"optimizer = {value}\n")
        _fails_with(capsys, ["train", "--config", str(listed)], "--optimizer", "is unknown; choose one of")


def test_out_that_cannot_be_a_directory(capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run directory")
    _fails_with(capsys, ["train", *TINY, "--out", str(a_file)], f"--out {a_file}", "not a directory")
    _fails_with(capsys, ["train", *TINY, "--out", str(a_file / "run")], "--out", "not a directory")
    typed = tmp_path / "typed.toml"
    typed.write_text("out = 5\n")
    _fails_with(capsys, ["train", *TINY, "--config", str(typed)], "--out 5", "path")
    assert a_file.read_text() == "not a run directory"


def test_corrupt_config_json_is_bad_input(capsys, tmp_path):
    """``--resume`` and ``generate`` read OUT/config.json: a damaged one is named in one line."""
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-1" / "metadata.json").write_text("{}")
    (tmp_path / "config.json").write_text('{"train": {"steps": ')
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), "--resume"], "config.json")
    _fails_with(capsys, ["generate", "--checkpoint", str(tmp_path)], "config.json")


def _run_with_config_json(out: Path, config: object) -> None:
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    (out / "checkpoints" / "step-1" / "metadata.json").write_text("{}")
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("model", "needles"), [
    (None, ['"model"']),
    ([32], ['"model"', "list"]),
    ({"embed_dim": 32, "bogus": 1}, ["'bogus'", "embed_dim"]),
    ({"embed_dim": "32"}, ["'embed_dim'", "'32'", "integer"]),
    ({"segment_lengths": 8}, ["'segment_lengths'", "list of integers"]),
    ({"tie_embeddings": "yes"}, ["'tie_embeddings'", "true or false"]),
    ({"embed_dim": 30, "num_heads": 4}, ["embed_dim", "num_heads"]),
])
def test_config_json_with_a_bad_model_is_bad_input(capsys, tmp_path, model, needles):
    """generate builds the model from config.json's "model": when that is not what distframe
    train writes, one line names the file and the key."""
    _run_with_config_json(tmp_path, {"train": {}} if model is None else {"train": {}, "model": model})
    _fails_with(capsys, ["generate", "--checkpoint", str(tmp_path)], "config.json", *needles)


def test_a_saved_model_that_is_not_the_checkpoints(capsys, tmp_path, corpus_file):
    """generate names where it read the model shape (the checkpoint's metadata; for checkpoints
    saved without one, config.json) when that does not fit the checkpoint's tensors."""
    from distframe.checkpoint.format import METADATA_CHECKSUM, metadata_checksum
    train(tmp_path, corpus_file, "--steps", "1", "--world-size", "1", "--eval-batches", "1")
    metadata = tmp_path / "checkpoints" / "step-1" / "metadata.json"
    meta = json.loads(metadata.read_text())
    for edit in ("info", "config.json"):
        if edit == "info":
            meta["info"]["model"]["num_layers"] += 1
        else:
            del meta["info"]
            config = json.loads((tmp_path / "config.json").read_text())
            config["model"]["num_layers"] += 1
            (tmp_path / "config.json").write_text(json.dumps(config))
        meta[METADATA_CHECKSUM] = metadata_checksum(meta)  # (the key itself left out)
        metadata.write_text(json.dumps(meta))
        capsys.readouterr()
        _fails_with(capsys, ["generate", "--checkpoint", str(tmp_path)],
                    "metadata.json" if edit == "info" else "config.json", "'blocks.2.", "step-1")


def test_config_json_with_bad_train_settings_is_bad_input(capsys, tmp_path):
    _run_with_config_json(tmp_path, {"train": [1], "model": {}})
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), "--resume"], "config.json",
                '"train"', "list")


def test_resume_with_steps_the_run_already_reached(capsys, tmp_path, corpus_file):
    """--resume --steps N at or below the checkpoint's step K: below, bad input saying to pass
    --steps above K; equal, the run is done (exit 0, one line). Neither changes OUT."""
    train(tmp_path, corpus_file, "--steps", "2", "--world-size", "1", "--eval-batches", "1")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    resume = ["train", "--out", str(tmp_path), "--data", corpus_file, "--resume"]
    _fails_with(capsys, [*resume, "--steps", "1"], "--steps 1", "step 2", "above 2")
    assert main([*resume, "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.count("\n") == 1
    assert "already reached step 2" in captured.out and "--steps above 2" in captured.out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(("saved", "given"), [("sgd", "adamw"), ("adamw", "sgd")])
def test_resume_under_another_base_optimizer(capsys, tmp_path, corpus_file, saved, given):
    """The checkpoint's optimizer state is the saved run's optimizer's: resuming under another
    failed with "KeyError: 'step'" (sgd to adamw) or dropped Adam's moments silently."""
    train(tmp_path, corpus_file, "--steps", "2", "--world-size", "1", "--eval-batches", "1",
          "--base-optimizer", saved)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    _fails_with(capsys, ["train", "--out", str(tmp_path), "--resume", "--steps", "3",
                         "--base-optimizer", given], f"--base-optimizer {given}", f"with {saved}")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resume_on_other_data_says_so(capsys, tmp_path, corpus_file):
    """A resumed run reading other tokens (the default corpus under another Python, a --data file
    edited since) went on without a word; it still goes on, with one line saying so."""
    out = tmp_path / "out"
    train(out, corpus_file, "--steps", "2", "--world-size", "1", "--eval-batches", "1")
    resume = ["train", "--out", str(out), "--resume", "--eval-batches", "1"]
    capsys.readouterr()
    assert main([*resume, "--steps", "3", "--data", corpus_file]) == 0
    assert "other data" not in capsys.readouterr().err
    edited = tmp_path / "edited.txt"
    edited.write_bytes(Path(corpus_file).read_bytes()[::-1])
    assert main([*resume, "--steps", "4", "--data", str(edited)]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "other data" in line]
    assert len(warning) == 1 and "sha256 differs" in warning[0] and str(edited) in warning[0]


@pytest.mark.parametrize(("size", "tokens"), [(40, 2), (600, 30)])
def test_data_too_short_for_one_validation_window(capsys, tmp_path, monkeypatch, size, tokens):
    """Enough text to train on, but the validation split (the last 5%) is shorter than one window:
    said before any rank starts, naming the split, where the ranks said "the data holds 2 tokens"."""
    data = tmp_path / "short.txt"
    data.write_bytes((bytes(range(65, 91)) * 30)[:size])
    monkeypatch.setattr("distframe.train.spawn", lambda *a, **k: pytest.fail("ranks started"))
    _fails_with(capsys, ["train", *TINY, "--data", str(data), "--out", str(tmp_path / "out")],
                f"validation split holds {tokens} tokens", "--seq-len 32")


def test_config_json_is_replaced_atomically(tmp_path, monkeypatch):
    from distframe import train_loop
    config = TrainConfig(out=str(tmp_path), resume=True)
    log = train_loop.MetricsLog(str(tmp_path))
    train_loop.prepare_out(config, {"model": {"seq_len": 64}}, log)

    def dies_midway(obj, f, **kwargs):
        f.write('{"model": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(train_loop.json, "dump", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        train_loop.prepare_out(config, {"model": {"seq_len": 32}}, log)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model": {"seq_len": 64}}


def test_debug_shows_the_traceback(capsys, tmp_path):
    assert main(["train", "--strategy", "bogus", "--debug", "--out", str(tmp_path)]) == 2
    assert "Traceback" in capsys.readouterr().err


def _distframe(*args: str) -> subprocess.Popen:
    """The console script when installed (else ``python -m distframe``) in a subprocess."""
    script = Path(sys.executable).with_name("distframe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "distframe"]
    return subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_exit_status_of_the_command(tmp_path):
    proc = _distframe("train", "--world-size", "3", "--batch-size", "4", "--out", str(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().count("\n") == 0 and "--world-size 3" in err and "Traceback" not in err


def test_ctrl_c_leaves_only_complete_checkpoints(tmp_path, corpus_file):
    out = tmp_path / "run"
    proc = _distframe("train", *TINY, "--data", corpus_file, "--out", str(out), "--steps", "100000",
                      "--checkpoint-every", "3", "--eval-every", "0")
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step-6" / "metadata.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    from distframe.checkpoint import consolidate
    steps = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    for step in steps:  # every step-N there is complete and loads
        assert (step / "metadata.json").exists()
        consolidate(step)
    latest = max(steps, key=lambda p: int(p.name.split("-")[1]))
    assert f"{latest}" in err


def test_help(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--segment-lengths" in out and "--resume" in out and "--world-size" in out


def test_a_full_disk_at_a_checkpoint_is_one_line_and_exit_2(capsys, tmp_path, corpus_file, monkeypatch):
    """As README says of an --out the run cannot write: it exited 1 (a CheckpointError) when the
    disk filled while a checkpoint was written; the last checkpoint stays (checkpoint tests)."""
    import safetensors.torch

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device "
                                          "(os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    status = main(["train", *TINY, "--data", corpus_file, "--out", str(tmp_path), "--steps", "1"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert status == 2 and "Traceback" not in err, err
    assert last.startswith("distframe: error: saving checkpoint") and "failed on ranks [0, 1] of 2: " \
        "ConfigError: cannot write its files in" in last and "free space there" in last, last
