"""A pipeline whose last stage returns a tuple, list or dict of tensors: ``model(x)`` and
``validation_loss`` join the micro-batches' outputs leaf by leaf and every rank of the pipeline
gets what the unsplit model returns (train_step already handed such an output to loss_fn)."""
import collections
import functools

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import PipelineParallelModel
from tests.models.common import SEED_LOCK

TOL = 1e-10  # float64


class Heads(nn.Module):
    """Returns ``kind`` of output: a tuple, a dict, or a list nesting both."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x)
        score = y.sum(-1)
        if self.kind == "tuple":
            return y, score
        if self.kind == "dict":
            return {"logits": y, "score": score}
        if self.kind == "nested":
            return [y, {"score": score, "pair": (score * 2, y[:, :1])}]
        if self.kind == "scalar":
            return y, score.mean()
        return collections.namedtuple("Out", "y score")(y, score)


def model_of(kind):
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), Heads(kind)).double()


def leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [leaf for item in items for leaf in leaves(item)]


def loss_of(output, target):
    first = leaves(output)
    return nn.functional.mse_loss(first[0], target) + sum(leaf.square().mean() for leaf in first[1:])


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 3, generator=g, dtype=torch.float64)


def run(backend, kind, m):
    x, y = data()
    model = PipelineParallelModel(model_of(kind), backend, num_microbatches=m).eval()
    with torch.no_grad():
        return model(x), float(model.validation_loss(x, y, loss_of))


@pytest.mark.parametrize("kind", ["tuple", "dict", "nested"])
@pytest.mark.parametrize("world,m", [(2, 2), (3, 4)])
def test_structured_output_reaches_every_rank_as_the_unsplit_model_returns_it(kind, world, m):
    x, y = data()
    dense = model_of(kind).eval()
    with torch.no_grad():
        expected = dense(x)
        expected_loss = float(loss_of(expected, y))
    for output, loss in spawn(functools.partial(run, kind=kind, m=m), world, timeout=30):
        assert type(output) is type(expected)
        if isinstance(expected, dict):
            assert list(output) == list(expected)
        assert len(leaves(output)) == len(leaves(expected))
        for got, want in zip(leaves(output), leaves(expected)):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        assert abs(loss - expected_loss) < TOL


@pytest.mark.parametrize("kind,match", [("scalar", "0-dim"), ("namedtuple", "got a Out")])
def test_outputs_that_cannot_be_joined_or_rebuilt_are_config_errors(kind, match):
    with pytest.raises(ConfigError, match=match):
        spawn(functools.partial(run, kind=kind, m=2), 2, timeout=30)


def backward_by_hand(backend, with_penalty):
    """``loss_fn(model(x), y).backward()`` on a pipeline, as one would write it for one process."""
    x, y = data()
    model = PipelineParallelModel(model_of("tuple"), backend, num_microbatches=2)
    loss = loss_of(model(x), y)
    if with_penalty:  # reaches the stage's own parameters: the backward ran, partly
        loss = loss + sum(p.pow(2).sum() for p in model.parameters())
    try:
        loss.backward()
    except ConfigError as exc:
        return str(exc)
    return "backward ran"


@pytest.mark.parametrize("with_penalty", [False, True])
def test_a_backward_by_hand_through_a_pipelines_output_names_train_step(with_penalty):
    # Without the penalty torch said "element 0 of tensors does not require grad"; with it the
    # backward ran and left only the penalty's gradients, without a word.
    for text in spawn(functools.partial(backward_by_hand, with_penalty=with_penalty), 2, timeout=30):
        assert "train_step" in text and "torch.no_grad()" in text, text


def test_outputs_under_no_grad_do_not_require_grad():
    for output, _ in spawn(functools.partial(run, kind="tuple", m=2), 2, timeout=30):
        assert not any(t.requires_grad for t in output)
