"""A backward over a forward whose weights changed since (an optimizer step or a load between them)
is refused, as torch refuses it.

Torch raises "modified by an inplace operation" when a step or a load writes the weights a pending
forward saved. ZeRO-1/2 make each parameter a ``.data`` view of a flat buffer and write the
gathered weights into that buffer, which leaves the parameters' version counters alone: the
backward ran silently with the new weights (a gradient 0.168 off the one at the weights used).
ZeRO-3/FSDP refused it, saying the forward had not run; their message now names this case."""
from __future__ import annotations

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import MixedPrecisionPolicy
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

CHANGED = r"modified by an inplace operation"


def _run(backend, strategy, policy, change):
    model_cls, opt_cls = STRATEGIES[strategy]
    settings = dict(SETTINGS[strategy], **({"mixed_precision": policy} if policy else {}))
    model = model_cls(build_model(), backend, **settings)
    opt = opt_cls(model, torch.optim.SGD, lr=0.5)
    (x1, y1), (x2, y2) = (rank_slice(b, backend.rank, backend.world_size) for b in global_batches(2, 8))
    loss_fn(model(x1), y1).backward()
    pending = model(x2)
    if change == "step":
        opt.step()
    else:
        model.load_state_dict(model.gather_full_parameters())
    loss_fn(pending, y2).backward()


@pytest.mark.parametrize("change", ["step", "load"])
@pytest.mark.parametrize("strategy,policy", [
    ("ddp", None), ("zero1", None), ("zero2", None), ("zero1", MixedPrecisionPolicy(param_dtype=torch.float32)),
    ("zero2", MixedPrecisionPolicy(param_dtype=torch.float32))])
def test_a_backward_after_the_weights_changed_is_refused_as_torch_refuses_it(strategy, policy, change):
    with pytest.raises(RuntimeError, match=CHANGED):
        spawn(lambda b: _run(b, strategy, policy, change), 2, timeout=30)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_zero3_and_fsdp_name_the_step_between(strategy):
    with pytest.raises(ConfigError, match=r"ran before the last optimizer step, which changed the weights"):
        spawn(lambda b: _run(b, strategy, None, "step"), 2, timeout=30)
