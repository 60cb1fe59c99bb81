"""The argument checks of HybridShardedModel (and the models built on it)."""
from __future__ import annotations

from typing import Any

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.mesh import ParallelDims
from distframe.models.pipeline_schedules import SCHEDULES

DATA_PARALLEL = ("ddp", "zero1", "zero2")


def check_arguments(dims: Any, backend: ICommunicationBackend, num_microbatches: Any, schedule: Any,
                    data_parallel: Any, virtual_stages: Any) -> None:
    if not isinstance(dims, ParallelDims):
        raise ConfigError(f"dims must be a distframe.mesh.ParallelDims, got {type(dims).__name__}")
    dims.validate(backend.world_size)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches={num_microbatches!r}: use a positive int")
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ConfigError(f"virtual_stages={virtual_stages!r}: use a positive int (model chunks per rank)")
    if (virtual_stages > 1) != (schedule == "interleaved_1f1b"):
        raise ConfigError(f"schedule={schedule!r} with virtual_stages={virtual_stages}: interleaved_1f1b "
                          "needs virtual_stages >= 2 chunks per rank, the other schedules 1")
    if virtual_stages > 1 and not dims.pp_enabled:
        raise ConfigError(f"virtual_stages={virtual_stages} needs pipeline parallelism (pp > 1): with "
                          f"pp={dims.pp} there are no stages to interleave; use pp >= 2, or "
                          "schedule='1f1b' and virtual_stages=1")
    if data_parallel not in DATA_PARALLEL:
        raise ConfigError(f"data_parallel={data_parallel!r}: choose one of {', '.join(DATA_PARALLEL)}")


def check_find_unused(find_unused: bool, data_parallel: str) -> None:
    if find_unused and data_parallel != "ddp":
        raise ConfigError(f"find_unused_parameters needs data_parallel='ddp': with {data_parallel!r} the "
                          "optimizer updates a flat shard that mixes parameters and cannot skip one")


def check_not_dense(optimizer: Any, replaced_dense: dict[int, tuple[Any, str]]) -> None:
    """ConfigError if ``optimizer`` holds a dense weight the tensor-parallel plan replaced
    (``replaced_dense``: id -> (weak reference, name); it was built before wrapping): it would
    step that orphan, whose gradient stays None, and leave the layer untrained."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref, name = replaced_dense.get(id(p), (None, ""))
            if ref is not None and ref() is p:
                raise ConfigError(
                    f"the optimizer holds the dense {name}, which tensor parallelism replaced by this "
                    f"rank's slice, so it would never train; build the optimizer after wrapping, over "
                    f"model.parameters(): torch.optim.{type(optimizer).__name__}(model.parameters(), ...)")
