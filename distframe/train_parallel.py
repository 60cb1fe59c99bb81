"""Whether the model-parallel settings of ``distframe train`` fit together, the world, the batch
and the model: the degrees (``--dp --tp --pp --cp``), ``--micro-batches``, ``--schedule`` and the
interleaved schedule's ``--virtual-stages``. Part of TrainConfig's validation (``config`` is a
TrainConfig); each error is a ConfigError naming the flags and what to change.
"""
from __future__ import annotations

from typing import Any

from distframe.errors import ConfigError
from distframe.train_strategies import STRATEGIES

INTERLEAVED = "interleaved_1f1b"


def check_schedule(config: Any) -> None:
    """``--virtual-stages`` above 1 if and only if ``--schedule interleaved_1f1b``."""
    v, schedule = config.virtual_stages, config.schedule
    if v > 1 and schedule != INTERLEAVED:
        raise ConfigError(f"--virtual-stages {v} (model chunks per pipeline rank) needs --schedule "
                          f"{INTERLEAVED}, not {schedule}; add --schedule {INTERLEAVED} or drop "
                          "--virtual-stages")
    if schedule == INTERLEAVED and v < 2:
        raise ConfigError(f"--schedule {INTERLEAVED} gives each pipeline rank several model chunks: "
                          "add --virtual-stages 2 (or more), or use --schedule 1f1b")


def check_model_parallel(config: Any, world: int) -> None:
    """The degrees (those left out inferred) multiply to ``world`` and split the batch, the
    sequence, the heads and the layers evenly."""
    dp, tp, pp = config.parallel_degrees(world)
    cp = config.cp
    if dp * tp * pp * cp != world:
        degrees = f"--dp {dp} x --tp {tp} x --pp {pp}" + (f" x --cp {cp}" if cp > 1 else "")
        raise ConfigError(f"{degrees} = {dp * tp * pp * cp}, but the world has {world} ranks; "
                          f"choose degrees whose product is {world} (or leave one of --dp, --tp, "
                          "--pp out to infer it)")
    check_divides(config.batch_size, dp, "--batch-size", f"--dp {dp} (each data-parallel "
                  "group trains on an equal share)")
    per_group = config.batch_size // dp
    if per_group % config.micro_batches:
        raise ConfigError(f"--micro-batches {config.micro_batches} does not divide the {per_group} "
                          f"sequences each data-parallel group trains on (--batch-size "
                          f"{config.batch_size} / --dp {dp}); use micro-batches that divide "
                          f"{per_group}, or a --batch-size that is a multiple of "
                          f"{dp * config.micro_batches}")
    shape = config.model_config(vocab_size=256)
    if shape.seq_len % cp:
        raise ConfigError(f"--cp {cp} does not divide --seq-len {shape.seq_len} (each rank holds an "
                          f"equal slice of every sequence); use a --seq-len that is a multiple of {cp}")
    if shape.num_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {shape.num_heads} attention heads; "
                          f"use a --tp that divides them, or --heads a multiple of {tp}")
    if pp > shape.num_layers + 2:
        raise ConfigError(f"--pp {pp} stages for {shape.num_layers} blocks (plus embedding "
                          f"and head); use --pp at most {shape.num_layers + 2} or more --layers")
    if config.schedule == INTERLEAVED:
        _check_interleaved(config, pp, shape.num_layers)
    if config.micro_batches > 1 and pp == 1:  # it was ignored: the batch ran whole
        raise ConfigError(f"--micro-batches {config.micro_batches} needs a pipeline (--pp 2 or more): "
                          "without one the batch is not split; leave it out, or use --grad-accum-steps "
                          "to accumulate gradients over smaller batches")


def _check_interleaved(config: Any, pp: int, blocks: int) -> None:
    """Interleaving needs a pipeline, micro-batches in whole rounds of ``pp`` (the schedule's
    order) and a layer for each of the ``pp * virtual_stages`` stages (the LM's pipeline layers
    are its blocks, its embedding and its head)."""
    v, m, layers = config.virtual_stages, config.micro_batches, blocks + 2
    if pp < 2:
        raise ConfigError(f"--schedule {INTERLEAVED} interleaves pipeline stages, but --pp is {pp}; "
                          "use --pp 2 or more, or drop --schedule and --virtual-stages")
    if m % pp:
        raise ConfigError(f"--micro-batches {m} is not a multiple of --pp {pp}: --schedule {INTERLEAVED} "
                          f"runs micro-batches in rounds of the pipeline size; use a multiple of {pp}")
    if pp * v > layers:
        raise ConfigError(f"--pp {pp} x --virtual-stages {v} = {pp * v} pipeline stages for {blocks} blocks "
                          f"(plus embedding and head: {layers} layers, at least one per stage); use "
                          f"--virtual-stages at most {layers // pp} or more --layers")


def check_accumulation(config: Any, world: int) -> None:
    """``--grad-accum-steps`` (times ``--micro-batches`` in a pipeline) divides the sequences each
    data-parallel rank trains on per step, in every world the run passes through (a world that
    does not divide the batch has an error of its own)."""
    steps = config.grad_accum_steps
    if steps == 1 or config.optimizer == "async":
        return
    parallel = STRATEGIES[config.strategy].model_parallel
    for size in config.elastic_world_sizes() if config.optimizer == "elastic" else [world]:
        dp = config.parallel_degrees(size)[0] if parallel else size
        micro = config.micro_batches if parallel else 1
        per_rank = config.batch_size // dp
        if config.batch_size % dp == 0 and per_rank % (steps * micro):
            each = f" x --micro-batches {micro}" if micro > 1 else ""
            raise ConfigError(f"--grad-accum-steps {steps}{each} does not divide the {per_rank} "
                              f"sequences each data-parallel rank trains on per step (--batch-size "
                              f"{config.batch_size} / {dp} ranks); use a --batch-size that is a multiple "
                              f"of {dp * steps * micro}, or fewer accumulation steps")


def check_divides(value: int, divisor: int, what: str, by: str) -> None:
    if value % divisor:
        raise ConfigError(f"{what} {value} is not divisible by {by}; use a multiple of {divisor}")
