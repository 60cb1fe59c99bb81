"""Bad input to the model-parallel strategies and the distributed optimizers: exit status 2 and
one line naming the flag and the fix, before any rank trains."""
from __future__ import annotations

import json

import pytest

from distframe.train_config import TrainConfig
from distframe.train_settings import resolve_config
from tests.train.conftest import TINY
from tests.train.test_bad_input import _fails_with


@pytest.mark.parametrize(("flags", "needles"), [
    (["--strategy", "hybrid", "--world-size", "4", "--dp", "2", "--tp", "2", "--pp", "2"],
     ["--dp 2 x --tp 2 x --pp 2 = 8", "4 ranks"]),
    (["--strategy", "hybrid", "--world-size", "4", "--tp", "3"],
     ["cannot infer --dp", "--tp 3 x --pp 1 x --cp 1 = 3 does not divide the world size 4"]),
    (["--strategy", "hybrid", "--world-size", "2", "--cp", "3"],  # no --dp fits: none is suggested
     ["cannot infer --dp", "--cp 3 = 3 does not divide", "product divides 2"]),
    (["--strategy", "pipeline", "--world-size", "2", "--dp", "3"],
     ["cannot infer --pp", "--dp 3 x --tp 1 = 3"]),
    (["--strategy", "pipeline", "--world-size", "2", "--micro-batches", "3"],
     ["--micro-batches 3", "--batch-size 8"]),
    (["--strategy", "hybrid", "--world-size", "2", "--tp", "2", "--micro-batches", "2"],  # was ignored
     ["--micro-batches 2 needs a pipeline", "--grad-accum-steps"]),
    (["--strategy", "tensor", "--world-size", "4", "--batch-size", "8"],
     ["--tp 4", "2 attention heads", "--heads"]),
    (["--strategy", "ddp", "--tp", "2"], ["--tp applies to --strategy tensor or hybrid"]),
    (["--strategy", "pipeline", "--cp", "2"], ["--cp applies to --strategy hybrid"]),
    (["--strategy", "hybrid", "--world-size", "4", "--dp", "1", "--cp", "2"],
     ["--dp 1 x --tp 1 x --pp 1 x --cp 2 = 2", "4 ranks"]),
    (["--strategy", "hybrid", "--world-size", "3", "--cp", "3"], ["--cp 3 does not divide --seq-len"]),
    (["--strategy", "zero2", "--optimizer", "compressed"],
     ["--optimizer compressed runs on --strategy ddp", "zero2"]),
    (["--optimizer", "elastic", "--backend", "gloo"], ["--optimizer elastic", "--backend inmemory"]),
    (["--compressor", "topk"], ["--compressor applies to --optimizer compressed"]),
    (["--optimizer", "compressed", "--compressor", "int8", "--topk-ratio", "0.5"],  # was ignored
     ["--topk-ratio applies to --compressor topk, not int8"]),
    (["--optimizer", "compressed", "--compressor", "topk", "--powersgd-rank", "4"],
     ["--powersgd-rank applies to --compressor powersgd, not topk"]),
    (["--optimizer", "adamw"], ["--optimizer 'adamw' is unknown", "--base-optimizer adamw"]),
    (["--optimizer", "elastic", "--elastic-schedule", "4"], ["--elastic-schedule", "STEP:WORLD"]),
    (["--optimizer", "elastic", "--elastic-schedule", "2:4,2:2"],
     ["--elastic-schedule", "step 2 twice", "one world size per step"]),
    (["--optimizer", "elastic", "--world-size", "2", "--elastic-schedule", "2:3"],
     ["--batch-size 8", "elastic world size 3"]),
    (["--optimizer", "elastic", "--steps", "6", "--elastic-schedule", "6:4"],
     ["--elastic-schedule", "step 6", "--steps 6", "below 6"]),
    (["--optimizer", "elastic", "--steps", "6", "--world-size", "2", "--elastic-schedule", "3:4,9:3"],
     ["--elastic-schedule", "step 9", "--steps 6", "below 6"]),
    (["--optimizer", "async", "--world-size", "1"], ["--optimizer async needs --world-size >= 2"]),
    (["--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2", "--virtual-stages", "2"],
     ["--virtual-stages 2", "--schedule interleaved_1f1b"]),
    (["--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2", "--schedule",
      "interleaved_1f1b"], ["--schedule interleaved_1f1b", "--virtual-stages 2"]),
    (["--strategy", "pipeline", "--world-size", "2", "--schedule", "interleaved_1f1b",
      "--virtual-stages", "2"], ["--micro-batches 1", "multiple of --pp 2"]),
    (["--strategy", "pipeline", "--world-size", "2", "--micro-batches", "2", "--schedule",
      "interleaved_1f1b", "--virtual-stages", "3"], ["--pp 2 x --virtual-stages 3 = 6", "at most 2"]),
    (["--strategy", "hybrid", "--world-size", "2", "--micro-batches", "2", "--schedule",
      "interleaved_1f1b", "--virtual-stages", "2"], ["--pp is 1", "--pp 2 or more"]),
    (["--strategy", "ddp", "--virtual-stages", "2"], ["--virtual-stages applies to --strategy pipeline"]),
    (["--strategy", "pipeline", "--virtual-stages", "0"], ["--virtual-stages 0", ">= 1"]),
])
def test_bad_flags(capsys, tmp_path, flags, needles):
    _fails_with(capsys, ["train", *TINY, "--out", str(tmp_path), *flags], *needles)


def test_toml_keys_mirror_the_new_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "hybrid"\ntp = 2\npp = 2\nmicro-batches = 2\nbase-optimizer = "sgd"\n')
    config = resolve_config({"world_size": 8}, str(path))
    assert (config.strategy, config.tp, config.micro_batches, config.base_optimizer) == (
        "hybrid", 2, 2, "sgd")
    assert config.parallel_degrees(8) == (2, 2, 2)
    assert TrainConfig(strategy="pipeline", world_size=4, dp=2).parallel_degrees(4) == (2, 1, 2)


def test_interleaved_schedule_and_virtual_stages_are_settings(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "hybrid"\npp = 2\nmicro-batches = 2\nschedule = "interleaved_1f1b"\n'
                    'virtual-stages = 2\n')
    config = resolve_config({"world_size": 4, "preset": "tiny"}, str(path))
    assert (config.schedule, config.virtual_stages, config.parallel_degrees(4)) == (
        "interleaved_1f1b", 2, (2, 1, 2))


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, ("interleaved_1f1b", 2)), ({"schedule": "1f1b"}, ("1f1b", 1)),
    ({"strategy": "ddp"}, ("1f1b", 1))])
def test_resumed_run_drops_virtual_stages_with_the_schedule(tmp_path, flags, expected):
    # A run saved under interleaved_1f1b and resumed with another --schedule: its saved
    # --virtual-stages would be refused under that schedule, though the user never passed it.
    saved = TrainConfig(preset="tiny", strategy="pipeline", world_size=2, micro_batches=2,
                        schedule="interleaved_1f1b", virtual_stages=2)
    (tmp_path / "config.json").write_text(json.dumps({"train": saved.to_json()}))
    config = resolve_config({"resume": True, "out": str(tmp_path), "world_size": 2, **flags})
    assert (config.schedule, config.virtual_stages) == expected


def test_help_documents_the_interleaved_schedule(capsys):
    from distframe.cli import main
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "interleaved_1f1b" in out and "--virtual-stages" in out


@pytest.mark.parametrize(("flags", "needles"), [
    # The world size is not taken from the saved run: the default 2 cannot hold its degrees.
    ((), ("the world has 2 ranks", "saved with --world-size 4 --dp 2 --tp 2", "not --world-size")),
    (("--world-size", "4", "--pp", "2"), ("--dp 2 x --tp 2 x --pp 2", "saved with --world-size 4 --dp 2")),
])
def test_resumed_run_names_the_saved_settings_an_error_is_about(capsys, tmp_path, flags, needles):
    # The user typed only --resume: an error about --dp and --tp must say where they came from.
    saved = TrainConfig(preset="tiny", strategy="hybrid", world_size=4, dp=2, tp=2)
    (tmp_path / "config.json").write_text(json.dumps({"train": saved.to_json()}))
    _fails_with(capsys, ["train", "--out", str(tmp_path), "--resume", *flags], *needles)
