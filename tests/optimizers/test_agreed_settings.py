"""Optimizers whose ranks must be built alike refuse settings that differ between ranks.

Before, GradientCompressionOptimizer with lr 0.1 on rank 0 and 0.2 on rank 1 trained replicas
that drifted apart without a word (so did error feedback on one rank only, and ElasticOptimizer
with a rate per rank), and an AsyncSGDOptimizer worker built with another rate, momentum,
staleness bound or ordering than its server's ran as if it had not. Construction now compares
every rank's settings (one all_gather of a digest) and raises the same ConfigError on every
rank, naming the setting and which ranks hold which value."""
import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from distframe.optimizers.compressed import GradientCompressionOptimizer
from distframe.optimizers.compression import Int8Compressor, TopKCompressor
from distframe.optimizers.elastic import ElasticOptimizer
from tests.models.common import SEED_LOCK


def _model(b):
    with SEED_LOCK:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return DDPModel(module, b)


def _batch(b):
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    n = 8 // b.world_size
    return x[b.rank * n:(b.rank + 1) * n], x[b.rank * n:(b.rank + 1) * n, :2].cos()


def _refusals(build, world):
    """Each rank's ConfigError message, where ``build(b)`` must raise one on every rank."""
    def fn(b):
        with pytest.raises(ConfigError) as refused:
            build(b)
        return str(refused.value)
    messages = spawn(fn, world, timeout=10)
    assert len(set(messages)) == 1, messages  # every rank says the same
    return messages[0]


def _compressed(b, **settings):
    kw = {"lr": 0.1, "compressor": TopKCompressor(0.3), **settings}
    return GradientCompressionOptimizer(_model(b), torch.optim.SGD, **kw)


LR = "param_groups[0].lr: "


@pytest.mark.parametrize("settings, says", [
    (lambda r: {"lr": 0.1 * (r + 1)}, LR + "0.1 on rank(s) [0], 0.2 on rank(s) [1]"),
    (lambda r: {"lr": torch.tensor(0.1 * (r + 1), dtype=torch.float64)}, LR + "0.1 on rank(s) [0], 0.2 on"),
    (lambda r: {"error_feedback": r == 0}, "error_feedback: True on rank(s) [0], False on rank(s) [1]"),
    (lambda r: {"compressor": TopKCompressor(0.1 * (r + 1))},
     "compressor: 'TopKCompressor(ratio=0.1)' on rank(s) [0], 'TopKCompressor(ratio=0.2)' on rank(s) [1]"),
    (lambda r: {"compressor": Int8Compressor(seed=r)}, "compressor_seed: 0 on rank(s) [0], 1 on rank(s) [1]"),
    (lambda r: {"momentum": 0.9 * r}, "param_groups[0].momentum: 0.0 on rank(s) [0], 0.9 on rank(s) [1]"),
])
def test_compression_settings_that_differ_between_ranks_are_refused(settings, says):
    message = _refusals(lambda b: _compressed(b, **settings(b.rank)), 2)
    assert message.startswith("GradientCompressionOptimizer") and says in message, message
    assert "the same settings on every rank" in message


def test_equal_settings_train_and_a_tensor_rate_is_no_trouble():
    def fn(b):
        model = _model(b)
        opt = GradientCompressionOptimizer(model, torch.optim.SGD, lr=torch.tensor(0.1),
                                           compressor=TopKCompressor(0.3))
        return model.train_step(_batch(b), nn.functional.mse_loss, opt)
    losses = spawn(fn, 2, timeout=10)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("settings, says", [
    (lambda r: {"lr": 0.1 * (r + 1)}, LR + "0.1 on rank(s) [0], 0.2 on rank(s) [1]"),
    (lambda r: {"lr": 0.1, "commit_every": 1 + r}, "commit_every: 1 on rank(s) [0], 2 on rank(s) [1]"),
])
def test_elastic_settings_that_differ_between_ranks_are_refused(settings, says):
    message = _refusals(lambda b: ElasticOptimizer(_model(b), torch.optim.SGD, **settings(b.rank)), 2)
    assert message.startswith("ElasticOptimizer") and says in message, message


@pytest.mark.parametrize("settings, says", [
    (lambda r: {"lr": 0.1 if r == 0 else 0.2}, LR + "0.1 on rank(s) [0], 0.2 on rank(s) [1, 2]"),
    (lambda r: {"momentum": 0.9 * (r > 0)}, "momentum: 0.0 on rank(s) [0], 0.9 on rank(s) [1, 2]"),
    (lambda r: {"max_staleness": 4 * (r != 2)}, "max_staleness: 4 on rank(s) [0, 1], 0 on rank(s) [2]"),
    (lambda r: {"deterministic": r == 0}, "deterministic: True on rank(s) [0], False on rank(s) [1, 2]"),
    (lambda r: {"server_rank": min(r, 1)}, "server_rank: 0 on rank(s) [0], 1 on rank(s) [1, 2]"),
])
def test_an_async_worker_built_unlike_its_server_is_refused(settings, says):
    def build(b):
        AsyncSGDOptimizer(_model(b), torch.optim.SGD, **{"lr": 0.1, **settings(b.rank)})
    message = _refusals(build, 3)
    assert message.startswith("AsyncSGDOptimizer") and says in message, message


def test_the_helper_names_missing_settings_and_ignores_key_order():
    from distframe.optimizers.agreed_settings import check_same_settings

    def fn(b):
        settings = {"a": 1, "b": [1, 2]} if b.rank == 0 else {"b": [1, 2], "a": 1}
        check_same_settings(b, settings, "Owner")  # the same settings, in another order
        with pytest.raises(ConfigError) as refused:
            check_same_settings(b, {"a": 1, **({"c": 3} if b.rank == 1 else {})}, "Owner")
        return str(refused.value)
    message = spawn(fn, 2, timeout=10)[0]
    assert "c: (not set) on rank(s) [0], 3 on rank(s) [1]" in message
