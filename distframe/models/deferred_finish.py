"""Gradient reductions finished at the optimizer step instead of inside backward.

DDP, ZeRO-1 and ZeRO-2 wait for their gradient collectives as the last act of a synchronising
backward (``GradientBuckets``), on the thread autograd finishes the backward on. For CUDA
tensors that is torch's one worker thread per GPU, shared by every in-memory rank (thread) using
that GPU: a rank waiting there for its peers keeps their backward from running, so they never
arrive. There the wait is deferred to the rank's own thread instead: ``defer`` records it, and
the rank's next ``optimizer.step()`` (any ``torch.optim`` optimizer, through a global step
pre-hook), ``model.synchronize_gradients()`` or next forward runs it, on every rank alike.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

_lock = threading.Lock()
# owner thread -> id(object deferring) -> its finish. Keyed by the Thread object, not its ident
# (which a later thread may reuse), and weakly: a thread that ended takes its entries along.
_pending: weakref.WeakKeyDictionary[threading.Thread, dict[int, Callable[[], None]]] = (
    weakref.WeakKeyDictionary())
_hook: Any = None


def defer(owner_thread: threading.Thread, key: int, finish: Callable[[], None], peers: list[int]) -> None:
    """Runs ``finish`` at ``owner_thread``'s next optimizer step, unless ``discard`` comes first."""
    global _hook
    with _lock:
        _pending.setdefault(owner_thread, {})[key] = finish
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_step)
    warnings.warn(
        f"in-memory ranks {peers} share this rank's GPU and so its autograd thread, where waiting "
        "for them would stop their backward: the gradient average completes at optimizer.step() "
        "or model.synchronize_gradients() instead of when backward returns. Call "
        "model.synchronize_gradients() before reading .grad (clip_grad_norm_), or give each "
        "rank its own GPU", RuntimeWarning, stacklevel=2)


def discard(owner_thread: threading.Thread, key: int) -> None:
    with _lock:
        waiting = _pending.get(owner_thread)
        if waiting is not None:
            waiting.pop(key, None)
            if not waiting:
                del _pending[owner_thread]


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _lock:
        waiting = _pending.pop(threading.current_thread(), {})
    for finish in waiting.values():
        finish()
