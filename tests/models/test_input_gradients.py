"""A backward pass that accumulates into no parameter (an input gradient or saliency map taken with
``torch.autograd.grad(out, x)``, ``backward(inputs=[x])``, or parameter gradients read with
``autograd.grad`` without accumulating them) before the step's own backward. ZeRO-3/FSDP ran each
unit's reduce-scatter of zeros at the end of such a pass and warned that every parameter got no
gradient; now only the step's backward reduces (its count of reduce-scatters equals a step without
the extra pass), nothing warns, and training equals one process on the global batch (float64,
1e-12). See [Note: a pass that only reads gradients] in distframe/models/backward_end.py."""
import copy
import warnings

import pytest
import torch

from distframe import spawn
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

WORLD, BATCH, STEPS = 2, 8, 3
TOLERANCE = 1e-12


def input_gradient(model, x):
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).sum(), x)
    return grad


def backward_to_input(model, x):
    x = x.clone().requires_grad_(True)
    model(x).sum().backward(inputs=[x])
    return x.grad


def parameter_gradients(model, x):
    """d(out)/d(parameters) of this rank's slice, read and not accumulated (the gathered ones under
    ZeRO-3/FSDP: the module's parameters as its forward sees them)."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    return torch.autograd.grad(model(x).sum(), params)


def same_forward(model, x):
    """One forward, an input gradient from it, then (in the step) a second forward's backward."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    return out


EXTRA_PASSES = {"autograd.grad(input)": input_gradient, "backward(inputs=[x])": backward_to_input,
                "autograd.grad(parameters)": parameter_gradients, "same forward": same_forward}


def train(strategy, extra_pass):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(copy.deepcopy(build_model()), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        reduce_scatters = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step, batch in enumerate(global_batches(STEPS, BATCH)):
                x, y = rank_slice(batch, backend.rank, backend.world_size)
                before = backend.stats.calls.get("reduce_scatter", 0)
                if extra_pass is not None and step > 0:
                    EXTRA_PASSES[extra_pass](model, x)
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                reduce_scatters.append(backend.stats.calls.get("reduce_scatter", 0) - before)
        return model.gather_full_parameters(), reduce_scatters

    return spawn(run, WORLD, timeout=30)


@pytest.mark.parametrize("extra_pass", sorted(EXTRA_PASSES))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_pass_that_accumulates_nothing_reduces_nothing(strategy, extra_pass):
    want = reference_run(global_batches(STEPS, BATCH))[-1]
    for params, reduce_scatters in train(strategy, extra_pass):
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE)
        # Step 0 runs no extra pass: each later step moves what it does.
        assert reduce_scatters == [reduce_scatters[0]] * STEPS
