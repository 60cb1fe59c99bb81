"""``distframe train``'s weight decay: on matrices (weights, embeddings), not on biases and norm
weights (1-D parameters), as GPT-2 and nanoGPT train, under every strategy and optimizer; every
parameter with ``--decay-all``; a run saved before the split resumes as it trained."""
from __future__ import annotations

import json

import pytest

from distframe.launch import spawn
from distframe.train_config import TrainConfig
from distframe.train_loop import build_model_and_optimizer
from distframe.train_settings import resolve_config
from attention.model import DilatedTransformerLM

CASES = [("ddp", "none", {}), ("zero2", "none", {}), ("fsdp", "none", {}), ("tensor", "none", {"tp": 2}),
         ("hybrid", "none", {"dp": 1, "pp": 2}), ("ddp", "compressed", {}), ("zero1", "elastic", {})]


def _decay_of_each_parameter(strategy, optimizer, extra, decay_all):
    """{parameter name: the weight decay its group applies} on rank 0, and the groups' count."""
    config = TrainConfig(preset="tiny", strategy=strategy, optimizer=optimizer, weight_decay=0.1,
                         decay_all=decay_all, world_size=2, **extra)

    def run(backend):
        module = DilatedTransformerLM(config.model_config(vocab_size=256))
        model, opt = build_model_and_optimizer(module, backend, config)
        # Every group's own setting, by the parameters the wrapped optimizer's groups hold.
        ids = {id(t): g["weight_decay"] for g in opt.param_groups for t in g["params"]}
        by_name = {}
        for name, p in model.named_parameters():
            if id(p) in ids:
                by_name[name] = ids[id(p)]
        return by_name, len(opt.param_groups), [g["weight_decay"] for g in opt.param_groups]
    return spawn(run, 2)[0]


@pytest.mark.parametrize("strategy,optimizer,extra", CASES)
def test_biases_and_norms_are_not_decayed(strategy, optimizer, extra):
    by_name, groups, decays = _decay_of_each_parameter(strategy, optimizer, extra, False)
    assert groups == 2 and decays == [0.1, 0.0]
    assert by_name or strategy in ("zero1", "zero2", "fsdp")  # those hold pieces of flat shards
    for name, decay in by_name.items():  # where the groups hold the parameters themselves
        undecayed = name.endswith("bias") or ".ln_" in name or "norm." in name
        assert decay == (0.0 if undecayed else 0.1), name
    _, groups, decays = _decay_of_each_parameter(strategy, optimizer, extra, True)
    assert groups == 1 and decays == [0.1]


def test_a_run_saved_before_the_split_resumes_decaying_everything(tmp_path):
    saved = TrainConfig(steps=4).to_json()
    del saved["decay_all"]
    (tmp_path / "config.json").write_text(json.dumps({"train": saved}))
    assert resolve_config({"resume": True, "out": str(tmp_path)}).decay_all is True
    assert resolve_config({"out": str(tmp_path)}).decay_all is False  # a new run in that --out


@pytest.mark.parametrize("value", [1, "yes", None])
def test_decay_all_must_be_a_boolean(value):
    from distframe.errors import ConfigError
    with pytest.raises(ConfigError, match="--decay-all"):
        TrainConfig(decay_all=value)


def test_the_flag_reaches_the_config():
    from distframe.cli import build_parser
    assert build_parser().parse_args(["train", "--decay-all"]).decay_all is True
    assert getattr(build_parser().parse_args(["train"]), "decay_all", None) is None  # not given


def _resumed_losses(tmp_path, corpus_file, name, *flags):
    """Train 2 steps (--weight-decay 0.01, a checkpoint at each), copy OUT, resume to step 4."""
    import shutil
    from tests.train.conftest import train
    base = tmp_path / "base"
    if not base.exists():
        train(base, corpus_file, "--steps", "2", "--world-size", "1", "--weight-decay", "0.01",
              "--checkpoint-every", "1")
    out = tmp_path / name
    shutil.copytree(base, out)
    return [r["train_loss"] for r in train(out, corpus_file, "--resume", "--steps", "4", *flags)
            if r["step"] > 2]


def test_resume_takes_a_new_weight_decay(tmp_path, corpus_file):
    # Before: the checkpoint's optimizer state put back the saved groups' decay, and the run
    # went on with 0.01 (bit-identical losses) while config.json recorded 5.
    kept = _resumed_losses(tmp_path, corpus_file, "kept")
    again = _resumed_losses(tmp_path, corpus_file, "again", "--weight-decay", "0.01")
    changed = _resumed_losses(tmp_path, corpus_file, "changed", "--weight-decay", "5")
    assert kept == again
    assert changed[0] == kept[0] and changed[1] != kept[1]  # step 3's update decays by 5
    assert json.loads((tmp_path / "changed" / "config.json").read_text())["train"]["weight_decay"] == 5


@pytest.mark.parametrize("saved,given", [({"weight_decay": 0.01}, {"weight_decay": 0.0}),
                                         ({"weight_decay": 0.01}, {"decay_all": True}),
                                         ({"weight_decay": 0.0}, {"weight_decay": 0.1})])
def test_resume_that_changes_the_decay_groups_is_refused_naming_the_flags(tmp_path, saved, given):
    # Before: the checkpoint's load failed on every rank with advice for the library API
    # ("pass the sharded optimizer an optimizer instance with them").
    from distframe.errors import ConfigError
    (tmp_path / "config.json").write_text(json.dumps({"train": TrainConfig(steps=4, **saved).to_json()}))
    with pytest.raises(ConfigError, match=r"--weight-decay / --decay-all: .* keep that layout"):
        resolve_config({"resume": True, "out": str(tmp_path), **given})
    assert resolve_config({"resume": True, "out": str(tmp_path), "weight_decay": 0.5 if saved["weight_decay"]
                           else 0.0}).steps == 4  # the same layout resumes


def test_a_config_file_key_written_both_ways_is_refused(tmp_path):
    from distframe.errors import ConfigError
    path = tmp_path / "run.toml"
    path.write_text("d-model = 64\nd_model = 32\n")
    with pytest.raises(ConfigError, match="'d-model' and 'd_model' name one setting"):
        resolve_config({}, str(path))
