"""Pipeline steps that one process handles or refuses, and that the pipeline must handle or refuse
alike: autograd off, nothing to train, a batch without a batch dimension, activations whose shape
changes between micro-batches, a stage whose output does not depend on its input, and a tied
weight's gradients zeroed in place between accumulating backwards. float64, 1e-10."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models.pipeline import PipelineParallelModel
from tests.models.common import SEED_LOCK

TOL = dict(rtol=1e-10, atol=1e-10)


def mse(out, target):
    return F.mse_loss(out, target)


def batches(count, rows=4, width=5, out=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g, dtype=torch.float64),
             torch.randn(rows, out, generator=g, dtype=torch.float64)) for _ in range(count)]


def seeded(build):
    with SEED_LOCK:
        torch.manual_seed(0)
        return build().to(torch.float64)


def mlp():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _train_step_under_no_grad(b):
    pipe = PipelineParallelModel(seeded(mlp), b, num_microbatches=2)
    with torch.no_grad():
        pipe.train_step(batches(1)[0], mse, torch.optim.SGD(pipe.parameters(), lr=0.1))


def test_a_step_with_autograd_off_is_refused_as_one_process_refuses_it():
    # One process: loss.backward() raises "element 0 of tensors does not require grad".
    # The pipeline skipped every backward and stepped nothing, returning a loss.
    with pytest.raises(ConfigError, match="autograd off"):
        spawn(_train_step_under_no_grad, 2, timeout=20)


def _detached_loss(b):
    pipe = PipelineParallelModel(seeded(mlp), b, num_microbatches=2)
    pipe.forward_backward(batches(1)[0], lambda out, target: mse(out.detach(), target))


def test_a_loss_that_needs_no_gradient_is_refused():
    with pytest.raises(ConfigError, match="does not require grad"):
        spawn(_detached_loss, 2, timeout=20)


def _zero_dim_targets(b):
    pipe = PipelineParallelModel(seeded(mlp), b, num_microbatches=1)
    x, _ = batches(1)[0]
    pipe.forward_backward((x, torch.tensor(0.5, dtype=torch.float64)), lambda o, t: (o.sum() - t) ** 2)


def test_a_zero_dim_batch_names_the_batch_dimension():
    with pytest.raises(ConfigError, match="0-dim"):
        spawn(_zero_dim_targets, 2, timeout=20)


class TrimPadding(nn.Module):
    """Drops the time steps that are zero in every row (a per-batch trim of trailing padding)."""

    def forward(self, x):
        used = (x.abs().sum(dim=(0, 2)) > 0).nonzero()
        return x[:, :int(used.max()) + 1 if len(used) else 1]


class SumTime(nn.Module):
    def forward(self, x):
        return x.sum(1)


def _shape_changes(b, schedule):
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 6, bias=False), TrimPadding(), nn.Linear(6, 3), SumTime()))
    x = torch.randn(8, 6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[4:, 3:] = 0  # micro-batches 2 and 3 (of 2 rows each) are shorter than 0 and 1
    pipe = PipelineParallelModel(model, b, num_microbatches=4, schedule=schedule, split_points=[2])
    pipe.forward_backward((x, torch.zeros(8, 3, dtype=torch.float64)), mse)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_activation_changing_shape_between_microbatches_is_named(schedule):
    # Was a CollectiveMismatchError of a recv (in-memory), a byte-count error (MPI) or a
    # timeout (Gloo): the receives of later micro-batches are posted with micro-batch 0's shape.
    with pytest.raises(ConfigError, match=r"stage 1's input.*\(2, 3, 6\).*\(2, 6, 6\)"):
        spawn(functools.partial(_shape_changes, schedule=schedule), 2, timeout=20)


class Constant(nn.Module):
    """Returns its own parameter for every row: the output does not depend on the input."""

    def __init__(self):
        super().__init__()
        self.value = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.value.expand(x.shape[0], 6)


def disconnected():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), Constant(), nn.Linear(6, 3))


def adamw(params):
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)


def _disconnected_steps(b, schedule):
    pipe = PipelineParallelModel(seeded(disconnected), b, num_microbatches=2, schedule=schedule,
                                 split_points=[2])
    opt = adamw(pipe.parameters())
    first = []
    for batch in batches(3):
        pipe.forward_backward(batch, mse)
        pipe.synchronize_gradients()
        first.append(pipe.local_parameters[0].param.grad)
        opt.step()
        opt.zero_grad()
    return first, pipe.gather_full_parameters()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layers_before_a_stage_that_ignores_its_input_get_no_gradient(schedule):
    # One process leaves .grad None on the first Linear, so AdamW leaves it alone; the pipeline
    # sent zeros back and AdamW's weight decay moved it.
    model = seeded(disconnected)
    opt = adamw(model.parameters())
    for x, y in batches(3):
        mse(model(x), y).backward()
        assert model[0].weight.grad is None
        opt.step()
        opt.zero_grad()
    results = spawn(functools.partial(_disconnected_steps, schedule=schedule), 2, timeout=20)
    for _, full in results:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)
    assert results[0][0] == [None, None, None]  # rank 0's first Linear, after each step's backward


V, E = 11, 6


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)

    def forward(self, ids):
        return self.emb(ids)


class Unembed(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, x):
        return x @ self.emb.weight.t()


def tied():
    embed = Embed()
    return nn.Sequential(embed, nn.Linear(E, E), nn.Tanh(), Unembed(embed.emb))


def cross_entropy(out, target):
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))


def token_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (4, 3), generator=g), torch.randint(0, V, (4, 3), generator=g))
            for _ in range(3)]


def _tied_zeroed_in_place(b):
    pipe = PipelineParallelModel(seeded(tied), b, num_microbatches=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    first, second, third = token_batches()
    pipe.forward_backward(first, cross_entropy)
    pipe.synchronize_gradients()
    pipe.forward_backward(second, cross_entropy)  # accumulates onto the synchronised sum
    opt.zero_grad(set_to_none=False)  # in place: the same .grad tensors, now zeros
    pipe.forward_backward(third, cross_entropy)
    pipe.synchronize_gradients()
    return {lp.name: lp.param.grad.clone() for lp in pipe.local_parameters}


def test_tied_gradients_zeroed_in_place_between_backwards_are_summed_whole():
    model = seeded(tied)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first, second, third = token_batches()
    for x, y in (first, second):
        cross_entropy(model(x), y).backward()
    opt.zero_grad(set_to_none=False)
    cross_entropy(model(third[0]), third[1]).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for grads in spawn(_tied_zeroed_in_place, 2, timeout=20):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], **TOL, msg=name)


class Scale(nn.Module):
    """Multiplies by a buffer it may share with another Scale; ``moving``: adds 0.1 to it in place
    at each training forward."""

    def __init__(self, scale, moving):
        super().__init__()
        self.register_buffer("scale", scale)
        self.moving = moving

    def forward(self, x):
        if self.moving and self.training:
            with torch.no_grad():
                self.scale.add_(0.1)
        return x * self.scale.clone()


def shared_buffer(moving):
    scale = torch.full((6,), 1.5, dtype=torch.float64)
    return nn.Sequential(nn.Linear(5, 6), Scale(scale, moving), nn.Tanh(), nn.Linear(6, 6), Scale(scale, moving),
                         nn.Linear(6, 3))


def _shared_buffer_steps(b, moving):
    pipe = PipelineParallelModel(seeded(functools.partial(shared_buffer, moving)), b, num_microbatches=1,
                                 split_points=[3])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    return [pipe.train_step(batch, mse, opt) for batch in batches(2)], pipe.gather_full_parameters()


def test_a_constant_buffer_shared_across_stages_trains_as_one_process():
    model = seeded(functools.partial(shared_buffer, False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(2):
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for got, full in spawn(functools.partial(_shared_buffer_steps, moving=False), 2, timeout=20):
        assert got == pytest.approx(losses, rel=1e-12)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)


def test_a_buffer_shared_across_stages_and_changed_in_place_is_refused():
    # Each stage holds its own copy: one process adds 0.1 twice a step to the one buffer, each
    # stage once to its copy, and checkpoints kept stage 0's. It trained another model silently.
    with pytest.raises(ConfigError, match=r"buffer '1.scale'.*ranks 0 and 1.*split_points"):
        spawn(functools.partial(_shared_buffer_steps, moving=True), 2, timeout=20)


def _frozen_tied_steps(b):
    model = seeded(tied)
    model[0].emb.weight.requires_grad_(False)  # and the head's, which is the same tensor
    pipe = PipelineParallelModel(model, b, num_microbatches=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # SGD skips the frozen weight
    for batch in token_batches():
        pipe.train_step(batch, cross_entropy, opt)
    return pipe.gather_full_parameters()


def test_a_frozen_weight_tied_across_stages_trains_as_one_process():
    # Fine-tuning with the embedding (and so the head) frozen; construction raised torch's
    # "cannot register a hook on a tensor that doesn't require gradient".
    model = seeded(tied)
    model[0].emb.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x, y in token_batches():
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for full in spawn(_frozen_tied_steps, 2, timeout=20):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)
