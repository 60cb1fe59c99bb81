"""Per-rank memory counted from real tensor storage, and bytes on the wire, against the ZeRO
formulas for float32 Adam."""
import types

import pytest
import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.launch import spawn
from tests.models.common import STRATEGIES, loss_fn

# bytes per parameter held by one rank, fp32 Adam (params 4, grads 4, two moments 8)
MEMORY = {"ddp": lambda n: 16, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
          "zero3": lambda n: 16 / n, "fsdp": lambda n: 16 / n}
# elements each rank sends and receives per step, as a multiple of the parameter count
WIRE = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}
_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         type, str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def reachable_storage_bytes(*roots) -> int:
    """Sum of distinct tensor storages reachable from ``roots`` through attributes, containers,
    dict keys and ``.grad`` (backends skipped: they can reach other ranks' tensors)."""
    seen_objects, seen_storage, total = set(), set(), 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, _SKIP) or isinstance(obj, ICommunicationBackend):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen_storage:
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def _measure(backend, strategy):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(wide_model(), backend, auto_wrap_min_params=1000)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 5, generator=g)
    loss_fn(model(x), y).backward()
    opt.step()  # state exists and gradients are still held: the point the formulas describe
    walked = reachable_storage_bytes(model, opt)
    footprint = model.memory_footprint()["total"]
    opt.zero_grad()
    model.train_step((x, y), loss_fn, opt)  # warm: every lazy buffer exists
    backend.stats.reset()
    model.train_step((x, y), loss_fn, opt)
    stats = backend.stats.snapshot()["bytes"]
    n = backend.world_size
    wire = (stats.get("all_reduce", 0) * 2 * (n - 1) / n + stats.get("reduce_scatter", 0) * (n - 1) / n
            + stats.get("all_gather", 0) * (n - 1))
    return walked, footprint, wire / 4


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world", [2, 4])
def test_memory_and_wire_volume_match_the_zero_formulas(strategy, world):
    params = sum(p.numel() for p in wide_model().parameters())
    pieces = 5 * 2  # parameter tensors (or units, buckets): padding and Adam step scalars
    for walked, footprint, wire in spawn(lambda b: _measure(b, strategy), world):
        expected = MEMORY[strategy](world) * params
        slack = pieces * (16 * world + 8)
        assert expected - 1 <= walked <= expected + slack, (walked, expected)
        assert footprint == walked
        factor = WIRE[strategy] * (world - 1) / world
        assert factor * params <= wire <= factor * params + pieces * world * 3 + 4, (wire, factor * params)


class SkippableMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 5)

    def forward(self, x, skip: bool = False):
        h = torch.tanh(self.a(x))
        return self.c(h if skip else torch.tanh(self.b(h)))


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_unit_prefetched_for_a_forward_that_skips_it_is_freed_when_the_forward_returns(strategy, grad):
    # Prefetch follows the previous forward's order, so `b` is gathered ahead of a forward that
    # then does not run it (evaluation of an early exit, say). It stayed gathered until the next
    # synchronising backward: through a whole evaluation loop, with no backward, for ever.
    def run(backend):
        torch.manual_seed(0)
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(SkippableMiddle(), backend, auto_wrap_min_params=100)
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        x, y = torch.randn(4, 32), torch.randn(4, 5)
        for _ in range(2):
            model.train_step((x, y), loss_fn, opt)
        with torch.set_grad_enabled(grad):
            model(x, skip=True)
        return [u.full.untyped_storage().nbytes() for u in model.units]
    for gathered_bytes in spawn(run, 2, timeout=20):
        assert gathered_bytes == [0, 0, 0]
