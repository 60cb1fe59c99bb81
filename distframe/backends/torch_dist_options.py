"""The options objects of torch.distributed calls, for the Gloo/NCCL engine (``torch_dist_engine``).

Process groups copy the options they are given, so one object per distinct value is built once
and reused: building one costs a few microseconds, which would otherwise be paid on every call.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from distframe.backends.types import ReduceOp

TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
             ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}
_BUILT: dict[tuple, Any] = {}


def options(cls: type, **fields: Any) -> Any:
    """A torch.distributed options object of class ``cls`` with ``fields`` set, built once per
    distinct value."""
    key = (cls, *fields.items())
    try:
        return _BUILT[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable value: build a fresh one
        key = None
    built = cls()
    for name, value in fields.items():
        setattr(built, name, value)
    if key is not None:
        _BUILT[key] = built
    return built


ALLREDUCE_OPTIONS = {op: options(dist.AllreduceOptions, reduceOp=torch_op)
                     for op, torch_op in TORCH_OPS.items()}
REDUCE_SCATTER_OPTIONS = {op: options(dist.ReduceScatterOptions, reduceOp=torch_op)
                          for op, torch_op in TORCH_OPS.items()}
