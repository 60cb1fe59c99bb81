"""ZeRO-3 and FSDP units whose forward returns something other than tensors in pytree containers:
a dataclass (a ModelOutput-style result) or an object torch's pytree cannot look into. A unit is
gathered again for its backward by a hook on its output's tensors; with none found, it was freed
after forward and its backward read freed storage ("setStorage: ... out of bounds for storage
of size 0"). Each case trains exactly like one process (float64, atol 1e-10)."""
import dataclasses

import pytest
import torch
from torch import nn

from tests.models.common import (HIDDEN, IN, OUT, SEED_LOCK, STRATEGIES, Block, global_batches,
                                 loss_fn, rank_slice)

STEPS, BATCH = 3, 12


@dataclasses.dataclass
class Result:
    value: torch.Tensor
    extra: dict


class Opaque:
    """Holds a tensor where torch's pytree does not look (not a container it knows)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Wrapped(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.block, self.make = Block(HIDDEN), make

    def forward(self, x):
        return self.make(self.block(x))


def result(value):
    return Result(value, {"scale": 1.0})


class Net(nn.Module):
    """``inner`` wraps a block whose output goes through ``make``; ``outer`` wraps the model's."""

    def __init__(self, inner, outer) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(IN, HIDDEN), Wrapped(inner), nn.Linear(HIDDEN, OUT)
        self.outer = outer

    def forward(self, x):
        return self.outer(self.out(self.mid(self.inp(x)).value))


def build(inner, outer) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return Net(inner, outer).double()


def unwrap(output):
    return output if isinstance(output, torch.Tensor) else output.value


MAKERS = {"dataclass": result, "opaque": Opaque}
# fsdp-root: one unit, the root, whose output is the model's; fsdp-units: each child its own unit
# (without prefetch, nothing but the hook on its output gathers 'mid' again for its backward).
CHILDREN = {"auto_wrap_policy": lambda module, name: name in ("inp", "mid", "out")}
CASES = {"zero3": ("zero3", {}),
         "zero3-kept": ("zero3", {"reshard_after_forward": False, "prefetch": False}),
         "fsdp-root": ("fsdp", {"auto_wrap_min_params": 10**9}),
         "fsdp-units": ("fsdp", CHILDREN),
         "fsdp-units-no-prefetch": ("fsdp", {**CHILDREN, "prefetch": False})}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", MAKERS)
def test_units_returning_dataclasses_or_opaque_objects_train_exactly(case, kind):
    from distframe.launch import spawn
    make = MAKERS[kind]
    strategy, settings = CASES[case]

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build(make, make), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(STEPS, BATCH):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size),
                             lambda output, y: loss_fn(unwrap(output), y), opt)
        return model.gather_full_parameters()

    reference = build(make, make)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for x, y in global_batches(STEPS, BATCH):
        loss_fn(unwrap(reference(x)), y).backward()
        opt.step()
        opt.zero_grad()
    for params in spawn(run, 2, timeout=20):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
