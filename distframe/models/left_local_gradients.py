"""ZeRO-3/FSDP units: gradients that backward passes under ``no_sync`` left on the units, with no
synchronising backward after them, reduced by the step's ``synchronize_gradients``.

[Note: a step after no_sync alone] ``no_sync`` backward passes keep each unit's gradients on its
parameters' ``.grad`` (or in its ``accumulated`` sum under a finer reduce_dtype); the synchronising
backward that ends an accumulation loop reduces them with its own. A loop whose last micro-batch
also ran under no_sync has none: the optimizer stepped the masters without them (only AdamW's weight
decay moved the weights, 0.052 off one process), without an error. So ``UnitLifecycle.finish``,
run outside a backward (the model's ``synchronize_gradients``: every optimizer step, ``train_step``,
``clip_grad_norm_``), reduces every unit, in unit order, when a no_sync backward accumulated
gradients since the last reduction and some are still held (``zero_grad`` drops them): the step of
one process on the whole accumulated batch. It does so inside no_sync too: the masters only ever
take reduced gradients, so a step there has no local gradients to take. Which path a rank takes
depends only on the calls it made (no_sync and the step are collective by contract), so every
rank issues the same reductions. DDP and ZeRO-1/2 do the same in their buckets ([Note: gradients
left local at the step] in gradient_buckets.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def holds_local_gradients(units: Sequence[Any]) -> bool:
    """Whether a unit (a ShardedUnit) still holds a gradient no reduction took: a parameter's
    ``.grad`` or the unit's ``accumulated`` sum (a reduction, like ``zero_grad``, clears both)."""
    return any(unit.accumulated is not None or any(p.grad is not None for p in unit.params)
               for unit in units)
