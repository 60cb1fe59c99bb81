"""``build_model_parallel``: the one entry point the main job uses to wrap a model for
``--strategy pipeline | tensor | hybrid``."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.mesh import ParallelDims, inferred_degree
from distframe.models.hybrid import HybridShardedModel
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.tensor_parallel_model import TensorParallelModel

MODEL_PARALLEL_STRATEGIES = ("pipeline", "tensor", "hybrid")


def build_model_parallel(strategy: str, model: nn.Module, backend: ICommunicationBackend, *,
                         dp: int | None = None, tp: int | None = None, pp: int | None = None,
                         cp: int = 1, micro_batches: int = 1, schedule: str = "1f1b", data_parallel: str = "ddp",
                         tp_plan: Mapping[str, str] | None = None, split_points: Sequence[int] | None = None,
                         virtual_stages: int = 1, dropout_seed: int | None = None) -> HybridShardedModel:
    """Wraps ``model`` for ``strategy`` over ``backend`` (collective on every rank).

    Degrees left as None are filled in: ``pipeline`` uses ``pp = world / dp`` (tp 1), ``tensor``
    ``tp = world / dp`` (pp 1), ``hybrid`` ``dp = world / (tp * pp * cp)``; ``dp`` defaults to 1
    otherwise. ``cp`` (context parallelism: each sequence split across ``cp`` ranks) needs
    ``hybrid``. ``schedule="interleaved_1f1b"`` with ``virtual_stages`` model chunks per pipeline
    rank needs ``pp > 1``. ``pipeline`` or ``tensor`` with ``dp == 1`` give a
    PipelineParallelModel or a TensorParallelModel; anything else a HybridShardedModel. Each
    takes a plain torch.optim optimizer over ``model.parameters()`` (``data_parallel="ddp"``), or
    ZeRO1Optimizer/ZeRO2Optimizer(model, cls, **kw) for ``"zero1"``/``"zero2"``. ``dropout_seed``:
    the seed of the dropout generators (HybridShardedModel's; with tp 1, each rank's own).
    """
    world = backend.world_size
    if strategy not in MODEL_PARALLEL_STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: choose one of {', '.join(MODEL_PARALLEL_STRATEGIES)}")
    for axis, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
            raise ConfigError(f"{axis}={degree!r}: a parallel degree is a positive int (or None, for dp, "
                              "tp and pp, to infer it from the world size)")
    if cp != 1 and strategy != "hybrid":
        raise ConfigError(f"context parallelism (cp={cp}) runs under --strategy hybrid; use it with --cp")
    if strategy == "pipeline":
        if tp not in (None, 1):
            raise ConfigError("--strategy pipeline runs without tensor parallelism; use --strategy hybrid with --tp")
        dp = dp or 1
        dims = ParallelDims(dp=dp, tp=1, pp=pp or inferred_degree(world, "pp", dp=dp, tp=1))
    elif strategy == "tensor":
        if pp not in (None, 1):
            raise ConfigError("--strategy tensor runs without pipelining; use --strategy hybrid with --pp")
        dp = dp or 1
        dims = ParallelDims(dp=dp, tp=tp or inferred_degree(world, "tp", dp=dp, pp=1), pp=1)
    else:
        tp, pp = tp or 1, pp or 1
        dims = ParallelDims(dp=dp or inferred_degree(world, "dp", tp=tp, pp=pp, cp=cp), tp=tp, pp=pp, cp=cp)
    dims.validate(world)
    if dims.dp == 1 and data_parallel == "ddp" and strategy == "pipeline":
        return PipelineParallelModel(model, backend, num_microbatches=micro_batches, schedule=schedule,
                                     split_points=split_points, virtual_stages=virtual_stages,
                                     dropout_seed=dropout_seed)
    if dims.dp == 1 and data_parallel == "ddp" and strategy == "tensor":
        return TensorParallelModel(model, backend, plan=tp_plan, dropout_seed=dropout_seed)
    return HybridShardedModel(model, backend, dims=dims, tp_plan=tp_plan, num_microbatches=micro_batches,
                              schedule=schedule, data_parallel=data_parallel, split_points=split_points,
                              virtual_stages=virtual_stages, dropout_seed=dropout_seed)

