"""Keeps the check for reads of resharded parameters (StandInReads) from changing which path
torch's transformer modules take.

[Note: torch's fused inference paths] nn.TransformerEncoder, nn.TransformerEncoderLayer and
nn.MultiheadAttention take a fused path where they may (eval mode, with grad off or none of their
tensors requiring grad) only if ``torch.overrides.has_torch_function`` is false, and any active
TorchFunctionMode makes it true. The paths differ in value: an encoder given a key padding mask
computes on a nested tensor and returns zeros at the padded positions, which its module-by-module
path computes (2.0 off in a 2-layer encoder, and so is an nn.Transformer's output, whose decoder
attends to them). With StandInReads active, the first call of each kind (every call under
``debug``) computed another function than the unwrapped model and the next call. So while a model
holding such a module is checked, global module hooks (a hook on the module itself keeps an encoder
layer off its fused path) pop this thread's StandInReads modes for the forward of such a module
that may take its fused path, and push them back after it. What torch's code of the module reads
itself is checked after its forward instead, before its own hooks reshard it: every parameter of a
MultiheadAttention (it reads out_proj's without calling out_proj, so out_proj as a unit of its own
is refused as before) and of an encoder layer without hooks on it or below (its fused path; with
hooks it takes the other path, calling its submodules); an encoder reads none.

Inside such a forward the check does not see reads in the forwards of other modules it runs (a
custom norm or activation, a subclass of these layers, a user's hooks) of parameters registered
outside it, and it refuses a read by torch's code after the NaN was computed, not before.
Training-mode forwards, and forwards with grad of such modules with trainable parameters (torch
keeps those off the fused paths), are checked throughout. Not covered: such a module that the loss
function runs from outside the model (a frozen teacher) takes the other path in the first call;
and a compiled model keeps the mode throughout: meeting the global hooks, Dynamo compiled none
of an FSDP encoder's code, in that call or later ones (and under Dynamo an encoder checking its
mask, as it does by default, does not take its nested path anyway).
The global hooks exist only while some thread checks such a model; every module call of the
process goes through them then (a thread-local lookup in threads that check nothing).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
# Private, but the only way to see the top of the mode stack (a user's mode entered inside the
# forward stays on top: torch keeps off its fused paths for it anyway).
from torch.overrides import _get_current_function_mode

from distframe.compile_support import _compiling_around
from distframe.models.stand_in_reads import StandInReads

FAST_PATH_MODULES = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)


class _Checks(threading.local):
    """This thread's StandInReads modes in use (innermost last) and, for each forward of a module
    that may take a fused path entered while they were, the module and the modes popped for it."""

    def __init__(self) -> None:
        self.modes: list[StandInReads] = []
        self.entered: list[tuple[nn.Module, list[StandInReads]]] = []


_checks = _Checks()
_lock = threading.Lock()
_hooks: list = []  # the global hooks' handles while some thread checks
_checking_threads = 0


@contextlib.contextmanager
def reads_checked(mode: StandInReads, model: nn.Module) -> Iterator[None]:
    """Inside, ``mode`` checks every torch call, but those of the forwards of torch's modules that
    may take a fused path where ``model`` (as called) holds one and is not compiled (see [Note:
    torch's fused inference paths])."""
    if not any(isinstance(m, FAST_PATH_MODULES) for m in model.modules()) or _compiling_around(model):
        with mode:
            yield
        return
    _count_checking(+1)
    try:
        with mode:
            _checks.modes.append(mode)
            depth = len(_checks.entered)
            try:
                yield
            finally:
                _checks.modes.pop()
                # A forward left without its hooks (a compiled one that raised): its modes go back.
                while len(_checks.entered) > depth:
                    _push(_checks.entered.pop()[1])
    finally:
        _count_checking(-1)


def _count_checking(change: int) -> None:
    global _checking_threads
    with _lock:
        _checking_threads += change
        if _checking_threads == 1 and not _hooks:
            _hooks.append(register_module_forward_pre_hook(_pre_forward))
            _hooks.append(register_module_forward_hook(_post_forward, always_call=True))
        elif _checking_threads == 0:
            for handle in _hooks:
                handle.remove()
            _hooks.clear()


def may_take_fast_path(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's modules with a fused inference path and may take it in
    this call: only in eval mode, with grad off or none of its parameters requiring grad (torch
    asks an encoder's first layer)."""
    if not isinstance(module, FAST_PATH_MODULES):
        return False
    if isinstance(module, nn.TransformerEncoder):
        if not len(module.layers):
            return False
        module = module.layers[0]
    return not module.training and not (
        torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()))


def read_directly(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that torch's code of ``module`` (one of FAST_PATH_MODULES) may read itself,
    not inside a submodule's call: see [Note: torch's fused inference paths]."""
    if isinstance(module, nn.MultiheadAttention):
        return list(module.parameters())
    if isinstance(module, nn.TransformerEncoderLayer) and not any(
            # torch's own test for the hooks that keep the layer off its fused path
            getattr(m, "_forward_hooks", None) or getattr(m, "_forward_pre_hooks", None)
            for m in module.modules()):
        return list(module.parameters())
    return []  # an encoder calls its layers and its norm


def _pre_forward(module: nn.Module, args: object) -> None:
    if not _checks.modes or not may_take_fast_path(module):
        return
    popped = []
    while isinstance(top := _get_current_function_mode(), StandInReads):
        top.__exit__(None, None, None)  # pops the top mode
        popped.append(top)
    # Entered even with none popped (an enclosing module's forward popped them): checked after it.
    _checks.entered.append((module, popped))


def _post_forward(module: nn.Module, args: object, output: object) -> None:
    # Not entered by _pre_forward: not checking, no fused path, or a global pre-hook before it raised.
    if not _checks.entered or _checks.entered[-1][0] is not module:
        return
    _push(_checks.entered.pop()[1])
    if output is None:  # torch calls it so after the forward raised: that error propagates
        return
    for param in read_directly(module):
        for mode in reversed(_checks.modes):
            mode.check_read(param)


def _push(popped: list[StandInReads]) -> None:
    for mode in reversed(popped):
        mode.__enter__()
