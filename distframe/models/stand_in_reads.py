"""StandInReads: refuses a read of a resharded unit's parameter while the model's forward or
train_step's loss function runs, where it would silently compute with NaN.

[Note: reads of a resharded parameter] Between uses a unit's parameters hold a NaN stand-in
([Note: parameters between uses] in sharded_unit.py). A parameter read outside the forward of the
unit that gathers it reads that NaN: a head tied by hand (``F.linear(h, self.emb.weight)`` in the parent's
forward, after ``self.emb`` ran and was resharded), or an L2 penalty over the parameters in the
loss function. The loss is NaN, every parameter trains into NaN, and nothing says why. So while the
model's forward and the loss function of ``train_step`` run, this TorchFunctionMode looks at the
arguments of every torch call (one level into lists and tuples, as ``torch.cat`` takes them) and
raises the model's ConfigError for an ``nn.Parameter`` whose data is a stand-in: its ``data_ptr()``
is a stand-in's (each parameter expands a NaN of its own, one element of its unit's). Only
Parameters are looked at (``type(a) is nn.Parameter``: activations pay a type check),
and calls that only read metadata (``p.shape``, ``p.dtype``, ``p.grad``, setting ``p.data`` as the
units' own hooks do) are not reads. A forward's own units are gathered by its hooks, so they never
hold a stand-in while it runs; the mode is thread-local and off once the forward returns, so
backward, and the recomputation that activation checkpointing runs inside it, never see it. Reads
in code the model does not run (a hand-written loop that computes a penalty before calling the
model, or an in-place edit between steps, whose RuntimeError is torch's) are not covered: they
would need a mode active always, a cost on every torch call.

[Note: which calls are checked] The mode costs about 2.2 us per torch call (torch calls Python for
each; the check itself adds 0.1 us): a 4-layer DilatedTransformerLM forward (d_model 256, seq 256,
batch 8) makes 3434 torch calls: 7 to 14 ms on a 220 ms CPU forward, and a larger share of a GPU
forward, whose CPU time is mostly such per-call costs (not measured). The reads it finds come from
how the code is written (a tied head, a penalty), the same at every step, so the model checks only
the first call of each kind (its forward with and without grad, in training and in eval mode;
train_step's loss function) that completes, and every call when the backend was made with
``debug=True``. A read on a path the first call did not take (a branch on the data, on the step) is
found only under ``debug``. The mode is off in the forwards of torch's modules that may take a fused
inference path, which an active mode would keep off it ([Note: torch's fused inference paths] in
stand_in_fast_paths.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

Parameter = nn.Parameter  # a module global: looked up for every argument of every call

# Tensor methods and properties that read a tensor's metadata, not its values.
METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "stride", "storage_offset", "data_ptr", "untyped_storage", "get_device",
    "__len__", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_"})
# Properties whose value is the parameter's values (``p.data``, ``p.T``): read them, read them all.
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def reads_values(func: Callable) -> bool:
    """Whether torch function ``func`` reads the values of its tensor arguments."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a Tensor property: bound to its getset_descriptor
        return name == "__get__" and getattr(func.__self__, "__name__", "") in VALUE_PROPERTIES
    return name not in METADATA_METHODS


class StandInReads(TorchFunctionMode):
    """Inside, a torch call reading a Parameter that holds a stand-in (its data at one of
    ``stand_ins``, data pointers) raises ``refuse(parameter)``. See the module's note."""

    def __init__(self, stand_ins: frozenset[int], refuse: Callable[[nn.Parameter], Exception]) -> None:
        super().__init__()
        self.stand_ins = stand_ins
        self.refuse = refuse

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        # It runs for every torch call of the forward: type checks, inlined, on the common path
        # (about 0.1 us a call above a mode that only calls ``func``; that one costs 2.5 us).
        for arg in args:
            kind = type(arg)
            if kind is Parameter:
                if arg.data_ptr() in self.stand_ins:
                    self._check(func, arg)
            elif kind is list or kind is tuple:
                for value in arg:
                    if type(value) is Parameter and value.data_ptr() in self.stand_ins:
                        self._check(func, value)
        if kwargs:
            for value in kwargs.values():
                if type(value) is Parameter and value.data_ptr() in self.stand_ins:
                    self._check(func, value)
            return func(*args, **kwargs)
        return func(*args)

    def check_read(self, param: nn.Parameter) -> None:
        """Raises ``refuse(param)`` if ``param`` holds one of the stand-ins: for a read made where
        the mode was off ([Note: torch's fused inference paths] in stand_in_fast_paths.py)."""
        if param.data_ptr() in self.stand_ins and param.numel():
            raise self.refuse(param)

    def _check(self, func: Callable, param: nn.Parameter) -> None:
        # A parameter of no elements has no value to read (its stand-in shares the NaN's pointer)
        if param.numel() and reads_values(func):
            raise self.refuse(param)
