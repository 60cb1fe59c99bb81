"""A hook the user put on a module that a strategy replaces (tensor parallelism's split layers,
dropout_seed's dropouts, context parallelism's ring attention) was dropped with it: the wrapped
model silently computed what the dense one would not (a hook zeroing an activation never ran).
It is now a ConfigError naming the module; a hook registered after wrapping, on the module that
is then there, runs. See [Note: hooks on replaced modules] in distframe/models/replaced_modules.py."""
import re

import pytest
import torch

from distframe import ConfigError, spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from tests.models.common import tiny_lm

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def zero_output(module, args, output):
    return output * 0


CASES = {  # (the module hooked, its name, what replaces it, the wrapping)
    "tensor parallel": (lambda lm: lm.blocks[1].mlp.fc_in, "blocks.1.mlp.fc_in", "tensor parallelism",
                        lambda m, b: TensorParallelModel(m, b)),
    "dropout_seed": (lambda lm: lm.blocks[0].dropout, "blocks.0.dropout", "dropout_seed",
                     lambda m, b: PipelineParallelModel(m, b, num_microbatches=2, dropout_seed=1)),
    "context parallel": (lambda lm: lm.blocks[0].attn.attention, "attention", "context parallelism",
                         lambda m, b: HybridShardedModel(m, b, dims=ParallelDims(cp=2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hook_on_a_replaced_module_is_refused(case):
    hooked, name, replaced_by, wrap = CASES[case]

    def run(backend):
        lm = tiny_lm(dropout=0.1 if case == "dropout_seed" else 0.0)
        hooked(lm).register_forward_hook(zero_output)
        try:
            wrap(lm, backend)
        except Exception as error:  # noqa: BLE001 - reported to the test
            return type(error), str(error)
        return None, "wrapped"

    pattern = rf"^{name} \(\w+\) has a forward hook, and {replaced_by} replaces that module"
    outcomes = spawn(run, 2, timeout=20)
    # Rank 0 holds the module (a pipeline's other stage does not, and stops at once: its peer left).
    assert outcomes[0][0] is ConfigError and re.match(pattern, outcomes[0][1]), outcomes[0]
    assert all(kind is not None for kind, _ in outcomes), outcomes


def test_a_hook_registered_after_wrapping_on_the_split_layer_runs():
    def run(backend):
        model = TensorParallelModel(tiny_lm(), backend)
        with torch.no_grad():
            before = model(TOKENS)
            calls = []
            model.module.blocks[1].mlp.fc_in.register_forward_hook(
                lambda module, args, output: calls.append(output.shape) or output * 0)
            after = model(TOKENS)
        return calls, bool(torch.equal(before, after))

    for calls, same in spawn(run, 2, timeout=20):
        assert len(calls) == 1 and not same
