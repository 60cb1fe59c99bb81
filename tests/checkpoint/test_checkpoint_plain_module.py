"""A plain nn.Module handed to checkpoint.load (single-process use of a checkpoint) is refused with
the way to do that: consolidate(path) and the module's own load_state_dict."""
import pytest
import torch

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model


def test_loading_into_a_plain_module_names_consolidate(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: checkpoint.save(path, STRATEGIES["zero3"][0](build_model(), b)), 2, timeout=30)
    plain = build_model(seed=3)
    with pytest.raises(ConfigError, match=r"consolidate\(path\)"):
        checkpoint.load(path, plain)
    plain.load_state_dict(checkpoint.consolidate(path))  # the way the message names
    for name, value in build_model().state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0)
