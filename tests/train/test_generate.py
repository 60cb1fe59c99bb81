"""``distframe generate`` on a tiny untrained model: prompts are bytes, sampling settings at their
edges give an answer or one line of bad input, never a traceback."""
from __future__ import annotations

import pytest
import torch

from attention import DilatedTransformerConfig, DilatedTransformerLM
from distframe import generate
from distframe.cli import main
from distframe.errors import ConfigError


@pytest.fixture
def model(monkeypatch):
    torch.manual_seed(0)
    config = DilatedTransformerConfig.preset("tiny", seq_len=16, segment_lengths=(4, 8, 16))
    lm = DilatedTransformerLM(config).double().eval()
    monkeypatch.setattr(generate, "load_model", lambda path: lm)
    return lm


def _sample(model, prompt=b"def ", **settings):
    settings = {"max_new_tokens": 6, "temperature": 0.8, "top_k": 0, "seed": 0, **settings}
    return generate.sample(model, prompt, **settings)


def test_prompt_bytes_that_are_not_utf8(model):
    """A command line holding bytes that are not UTF-8 reaches Python as surrogate escapes; the
    model reads the bytes themselves (it is a byte-level model)."""
    text = generate.generate_text("run", "a\udcff\udcfe", max_new_tokens=0)
    assert text == "a\ufffd\ufffd"
    seen = generate.generate_text("run", "a\udcff\udcfe", max_new_tokens=3, temperature=0)
    expected = _sample(model, b"a\xff\xfe", max_new_tokens=3, temperature=0)
    assert seen == expected.decode("utf-8", errors="replace")


@pytest.mark.parametrize("temperature", [1e-300, 1e-320])
def test_tiny_temperature_is_greedy(model, temperature):
    greedy = _sample(model, temperature=0)
    assert _sample(model, temperature=temperature) == greedy
    assert _sample(model, temperature=temperature, top_k=5) == greedy


@pytest.mark.parametrize("settings", [dict(temperature=float("nan")), dict(temperature=-1.0),
                                      dict(top_k=-1), dict(max_new_tokens=-1),
                                      dict(seed=2 ** 64)])
def test_bad_settings(model, settings):
    with pytest.raises(ConfigError, match="--tokens, --temperature and --top-k|--seed"):
        _sample(model, **settings)


def test_bad_settings_on_the_command_line(model, capsys):
    assert main(["generate", "--checkpoint", "run", "--temperature", "nan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--temperature" in err and "Traceback" not in err


def test_an_empty_prompt_returns_the_continuation_only(model):
    """With no prompt the model is seeded with a newline, which the returned text began with,
    though the user never typed it; the seed still conditions the model."""
    assert _sample(model, b"", max_new_tokens=0) == b""
    assert generate.generate_text("run", "", max_new_tokens=0) == ""
    continuation = _sample(model, b"", max_new_tokens=4, temperature=0)
    assert continuation == _sample(model, b"\n", max_new_tokens=4, temperature=0)[1:]
    assert len(continuation) == 4
    text = generate.generate_text("run", "", max_new_tokens=4, temperature=0)
    assert text == continuation.decode("utf-8", errors="replace")
