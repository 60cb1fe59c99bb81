"""The README's library example trains like one process (float32, 1e-5)."""
import importlib.util
from pathlib import Path

import torch

from distframe import spawn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_spawn.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("train_spawn_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_matches_single_process_training():
    ex = _load_example()
    results = spawn(ex.worker, 4)
    model = ex.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in ex.global_batches():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    expected = model.state_dict()
    for losses, params in results:
        assert losses[-1] < losses[0]
        for name, tensor in expected.items():
            torch.testing.assert_close(params[name], tensor, rtol=1e-5, atol=1e-5)
