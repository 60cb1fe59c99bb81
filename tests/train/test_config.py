"""TrainConfig: precedence of defaults, a resumed run's settings, TOML and flags; validation;
the learning-rate schedule."""
from __future__ import annotations

import json

import pytest

from distframe.errors import ConfigError
from distframe.train_config import TrainConfig
from distframe.train_settings import resolve_config
from distframe.train_loop import learning_rate


def test_defaults_are_the_small_preset_on_two_ranks():
    config = TrainConfig()
    model = config.model_config(vocab_size=256)
    assert (config.preset, config.strategy, config.world_size) == ("small", "ddp", None)
    assert (model.num_layers, model.embed_dim, model.seq_len) == (4, 256, 1024)


def test_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "zero2"\npreset = "tiny"\nd-model = 64\n'
                    'segment_lengths = [16, 32, 64]\nsteps = 7\nlr = 0.01\n')
    config = resolve_config({"steps": 9}, str(path))
    assert (config.strategy, config.preset, config.d_model, config.steps, config.lr) == \
        ("zero2", "tiny", 64, 9, 0.01)
    assert config.segment_lengths == (16, 32, 64)
    assert config.model_config(vocab_size=256).embed_dim == 64


def test_resume_takes_the_saved_settings_but_not_how_it_was_launched(tmp_path):
    saved = TrainConfig(preset="tiny", steps=40, strategy="zero1", world_size=4, batch_size=8)
    (tmp_path / "config.json").write_text(json.dumps({"train": saved.to_json()}))
    config = resolve_config({"resume": True, "out": str(tmp_path), "strategy": "fsdp"})
    assert (config.preset, config.steps, config.batch_size) == ("tiny", 40, 8)
    assert config.strategy == "fsdp" and config.world_size is None and config.resume


@pytest.mark.parametrize(("value", "compiler"), [("true", "inductor"), ("false", None),
                                               ('"aot_eager"', "aot_eager")])
def test_compile_in_a_config_file(tmp_path, value, compiler):
    path = tmp_path / "run.toml"
    path.write_text(f"compile = {value}\n")
    assert resolve_config({}, str(path)).compile == compiler


def test_a_resumed_run_does_not_take_the_saved_compile(tmp_path):
    """How the blocks ran (compiled or not) is how the run was launched, not what it trains."""
    saved = TrainConfig(preset="tiny", compile="aot_eager")
    (tmp_path / "config.json").write_text(json.dumps({"train": saved.to_json()}))
    assert resolve_config({"resume": True, "out": str(tmp_path)}).compile is None
    assert resolve_config({"resume": True, "out": str(tmp_path), "compile": "eager"}).compile == "eager"


@pytest.mark.parametrize(("settings", "needle"), [
    ({"strategy": "pipeline-of-doom"}, "--strategy"),
    ({"world_size": 3, "batch_size": 4}, "--world-size 3 does not divide --batch-size 4"),
    ({"preset": "tiny", "segment_lengths": "16,32,128"}, "--segment-lengths 16,32,128 do not fit"),
    ({"preset": "tiny", "heads": 3}, "divisible"),
    ({"segment_lengths": "a,b"}, "comma-separated"),
    ({"preset": "tiny", "segment_lengths": [16.5, 32, 64]}, "comma-separated"),  # TOML floats
    ({"preset": "tiny", "dilation_rates": [True, 2, 4]}, "comma-separated"),
    ({"eval_every": -1}, "--eval-every"),
    ({"dtype": "float8"}, "--dtype"),
])
def test_validation_names_the_flag(settings, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(**settings)


def test_learning_rate_schedule():
    config = TrainConfig(lr=1.0, warmup_steps=10, steps=110)
    assert learning_rate(config, 1) == pytest.approx(0.1)
    assert learning_rate(config, 10) == pytest.approx(1.0)
    assert learning_rate(config, 60) == pytest.approx(0.55)
    assert learning_rate(config, 110) == pytest.approx(0.1)
    rates = [learning_rate(config, s) for s in range(10, 111)]
    assert rates == sorted(rates, reverse=True)
