"""Pipeline stages unlike a plain stack of blocks: integer activations between stages, a stage that
starts with an in-place layer, a stage whose output is not one tensor. Each equals the unsplit
model (float64, 1e-10) or is a ConfigError naming the fix, as is state no pipeline layer holds."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models.pipeline import PipelineParallelModel
from tests.models.common import SEED_LOCK
from tests.models.test_pipeline import _pipeline_run, _reference, data, mse


def check_equals_unsplit(model, world_size, schedule, split_points=None):
    """Loss, output and every gradient of the pipelined ``model`` (2 micro-batches) equal the
    unsplit model's on one batch of 8."""
    x, y = data(8)
    loss, out, grads = _reference(model, x, y)
    results = spawn(lambda b: _pipeline_run(b, model, x, y, 2, schedule, split_points=split_points),
                    world_size, timeout=20)
    for rank_loss, rank_out, rank_grads in results:
        assert rank_loss == pytest.approx(loss, rel=1e-12)
        torch.testing.assert_close(rank_out, out, rtol=1e-10, atol=1e-10)
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-10, atol=1e-10, msg=name)


class _Bucketize(nn.Module):
    """A parameterless first layer whose output is integer (bucket ids): nothing to differentiate."""

    def forward(self, x):
        return torch.bucketize(x, torch.linspace(-2, 2, 7, dtype=x.dtype))


class _BucketEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(8, 4)

    def forward(self, ids):
        return self.embedding(ids).sum(1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_integer_activation_between_stages(schedule):
    # Stage 1 receives integers: it has no input gradient to send back, so stage 0 must not wait
    # for one (it used to block until the timeout).
    with SEED_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(_Bucketize(), _BucketEmbedding(), nn.Linear(4, 3)).double()
    check_equals_unsplit(model, 3, schedule, split_points=[1, 2])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stage_that_starts_with_an_inplace_layer_equals_unsplit(schedule):
    # Cut before nn.ReLU(inplace=True) (the balanced cut of this model, as in torchvision's
    # ResNet and VGG): the received activation was a leaf requiring grad, which an in-place
    # layer may not modify (RuntimeError), though the unsplit model runs.
    with SEED_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True),
                              nn.Linear(8, 3)).double()
    check_equals_unsplit(model, 2, schedule)


class _Pair(nn.Module):
    def forward(self, x):
        return x, x


def test_stage_output_that_is_not_a_tensor_is_a_config_error():
    model = nn.Sequential(nn.Linear(5, 3), _Pair(), nn.Identity()).double()

    def run(b):
        PipelineParallelModel(model, b, num_microbatches=2, split_points=[2]).forward_backward(data(4), mse)

    with pytest.raises(ConfigError, match="one tensor"):
        spawn(run, 2, timeout=20)


@pytest.mark.parametrize("split_points", [[1.5, 3], [True, 3], "13", 2, [None, 3], [torch.tensor(1.5), 3]])
def test_split_points_that_are_not_ints_are_a_config_error(split_points):
    # A float or a string reached range() or sorted() and raised a TypeError naming neither the
    # setting nor the fix; True passed as layer 1.
    from distframe.models.stages import partition
    with pytest.raises(ConfigError, match=r"split_points=.*\(ints\)"):
        partition([1, 1, 1, 1], 3, split_points)


def test_split_points_accept_numpy_and_torch_integers():
    import numpy as np
    from distframe.models.stages import partition
    expected = [range(0, 1), range(1, 3), range(3, 4)]
    assert partition([1, 1, 1, 1], 3, [np.int64(1), torch.tensor(3)]) == expected


class _LayersWithRootState(nn.Module):
    """Its ``pipeline_layers()`` leave out a parameter or buffer held by the module itself."""

    def __init__(self, root):
        super().__init__()
        self.first, self.second = nn.Linear(5, 4), nn.Linear(4, 3)
        if root == "parameter":
            self.scale = nn.Parameter(torch.ones(4))
        else:
            self.register_buffer("scale", torch.ones(4))

    def pipeline_layers(self):
        return [("first", self.first), ("second", self.second)]


@pytest.mark.parametrize("root", ["parameter", "buffer"])
def test_state_that_no_pipeline_layer_holds_is_a_config_error(root):
    # 'scale' sat on no stage: it was never trained, and gather_full_parameters (and so every
    # checkpoint) then failed with KeyError('scale').
    def run(b):
        try:
            PipelineParallelModel(_LayersWithRootState(root).double(), b, num_microbatches=2)
        except ConfigError as error:
            return str(error)

    for message in spawn(run, 2, timeout=20):
        assert message is not None and f"{root} 'scale'" in message and "pipeline_layers()" in message


class _Spectrum(nn.Module):
    """A complex activation between stages (an FFT mixer): differentiable, not floating point."""

    def forward(self, x):
        return torch.fft.fft(x)


class _Signal(nn.Module):
    def forward(self, x):
        return torch.fft.ifft(x * torch.arange(1, x.shape[-1] + 1)).real


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_complex_activation_between_stages_equals_unsplit(schedule):
    # Its header had no dtype code (ValueError 'torch.complex128 is not in list'); and a complex
    # input was not given requires_grad, so the stages before it would get no gradient.
    with SEED_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), _Spectrum(), _Signal(), nn.Linear(4, 3)).double()
    check_equals_unsplit(model, 2, schedule, split_points=[2])
