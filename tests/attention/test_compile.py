"""The LM compiled ([Note: dilated attention under torch.compile] in attention/__init__.py): its
blocks compiled in place (what ``distframe train --compile`` does) or the whole LM, trained with
AdamW in float64 with an evaluation pass after the third step, must give the uncompiled run's
losses to 1e-12 at every step, with attention dropout and activation checkpointing too. Traced by
Dynamo on Python 3.12, the attention's cached plans made the loss leave the uncompiled one two
steps after the evaluation pass (torch 2.11), or failed Dynamo (torch 2.13); on Python 3.11, where
CI runs, they were exact. ``eager`` and ``aot_eager`` need no C compiler; inductor ran on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention.model import DilatedTransformerLM
from attention_helpers import tiny_lm_config

STEPS = 6


def _losses(compile_as: str | None, backend: str, **overrides) -> tuple[list[float], int]:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    config = tiny_lm_config(**overrides)
    torch.manual_seed(0)
    model = DilatedTransformerLM(config).double()
    forward = model
    if compile_as == "blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    elif compile_as == "whole":
        forward = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        x = torch.randint(0, 64, (4, 32), generator=tokens)
        torch.manual_seed(100 + step)  # the same dropout masks on both sides
        loss = F.cross_entropy(forward(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 2:
            model.eval()
            with torch.no_grad():
                forward(x)
            model.train()
    return losses, counters["stats"]["unique_graphs"] - graphs


@pytest.mark.parametrize("compile_as,backend,overrides", [
    ("blocks", "eager", {}), ("blocks", "aot_eager", {}), ("whole", "aot_eager", {}),
    ("blocks", "aot_eager", {"dropout": 0.1}),
    ("blocks", "aot_eager", {"activation_checkpointing": True}),
])
def test_compiled_lm_trains_like_the_uncompiled_one(compile_as, backend, overrides):
    expected, _ = _losses(None, backend, **overrides)
    losses, graphs = _losses(compile_as, backend, **overrides)
    assert graphs > 0, "nothing was compiled"
    assert losses == pytest.approx(expected, rel=0, abs=1e-12)
