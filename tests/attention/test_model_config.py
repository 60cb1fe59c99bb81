"""DilatedTransformerConfig refuses, naming the field, values that used to pass its checks and
then fail inside torch or give NaN logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attention import DilatedTransformerConfig, DilatedTransformerLM
from distframe.errors import ConfigError


@pytest.mark.parametrize("field,value,message", [
    ("seq_len", 64.0, "seq_len must be a positive integer, got 64.0"),  # failed in nn.Embedding
    ("embed_dim", 32.0, "embed_dim must be a positive integer"),
    ("num_layers", True, "num_layers must be a positive integer, got True"),  # one layer, silently
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("segment_lengths", (16.0, 32, 64), "segment_lengths must hold positive integers, got 16.0"),
    ("dilation_rates", (1, 2, 0), "dilation_rates must hold positive integers, got 0"),
    ("layer_norm_eps", -1e-5, "layer_norm_eps must be a positive finite number"),  # NaN logits
    ("layer_norm_eps", float("nan"), "layer_norm_eps must be a positive finite number"),
    ("layer_norm_eps", 0.0, "layer_norm_eps must be a positive finite number"),
    ("dropout", "0.1", r"dropout must be a number in \[0, 1\), got '0.1'"),  # failed on '<='
    ("tie_embeddings", "false", "tie_embeddings must be True or False, got 'false'"),  # tied
    ("tie_embeddings", 0, "tie_embeddings must be True or False, got 0"),
    ("segment_lengths", 64, "segment_lengths must be a sequence of positive integers"),
])
def test_values_of_the_wrong_kind_are_a_config_error_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DilatedTransformerConfig.preset("tiny", **{field: value})


def test_numpy_integers_are_held_as_python_ints_and_build_the_same_model():
    """Shapes read from a config file as numpy integers are integers."""
    config = DilatedTransformerConfig.preset(
        "tiny", seq_len=np.int64(64), num_heads=np.int32(2),
        segment_lengths=np.array([16, 32, 64]), dilation_rates=[np.int64(1), 2, 4])
    assert config == DilatedTransformerConfig.preset("tiny")
    assert type(config.seq_len) is int and all(type(w) is int for w in config.segment_lengths)
    torch.manual_seed(0)
    ours = DilatedTransformerLM(config)
    torch.manual_seed(0)
    ref = DilatedTransformerLM(DilatedTransformerConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (1, 64))
    assert torch.equal(ours(tokens), ref(tokens))
