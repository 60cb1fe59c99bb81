"""A wrapped ``torch.compile(net)`` is named as ``net``: its checkpoints load into ``net`` wrapped
uncompiled (and back), and ``gather_full_parameters()`` / ``consolidate`` give ``net``'s keys.

A compiled module's names carry "_orig_mod.": the checkpoint of FSDPModel(torch.compile(net))
refused to load into FSDPModel(net) ("parameter '0.weight' is not in the checkpoint"), and its
consolidated state dict did not load into net. One in-memory rank runs compiled code (see
compile_support), and the "eager" backend keeps it quick."""
from __future__ import annotations

import pytest
import torch

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import SETTINGS, STRATEGIES, build_model


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_a_compiled_model_is_named_as_the_module_it_compiles(tmp_path, strategy):
    model_cls, opt_cls = STRATEGIES[strategy]
    path = tmp_path / "ckpt"

    def save(backend):
        model = model_cls(torch.compile(build_model(), backend="eager"), backend, **SETTINGS[strategy])
        model(torch.randn(2, 6, dtype=torch.float64))
        checkpoint.save(path, model, opt_cls(model, torch.optim.Adam, lr=1e-2), step=0)
        return model.gather_full_parameters()

    def load(backend):
        model = model_cls(build_model(seed=5), backend, **SETTINGS[strategy])
        checkpoint.load(path, model, opt_cls(model, torch.optim.Adam, lr=1e-2))
        return model.gather_full_parameters()

    saved = spawn(save, 1)[0]
    assert list(saved) == list(build_model().state_dict())
    build_model(seed=5).load_state_dict(checkpoint.consolidate(path))
    loaded = spawn(load, 1)[0]
    assert all(torch.equal(loaded[name], value) for name, value in saved.items())


def test_a_module_is_not_taken_for_compiled_while_another_thread_imports_dynamo(monkeypatch):
    # Building a process's first torch.optim optimizer imports torch._dynamo (1.5-3 s); a wrapped
    # model's forward on another thread read the half-built eval_frame module and failed with
    # "partially initialized module 'torch._dynamo.eval_frame' has no attribute 'OptimizedModule'".
    import sys
    import types

    from distframe.compile_support import is_compiled_module
    monkeypatch.setitem(sys.modules, "torch._dynamo.eval_frame", types.ModuleType("torch._dynamo.eval_frame"))
    assert not is_compiled_module(torch.nn.Linear(2, 2))
