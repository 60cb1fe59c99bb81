"""Whether the model-parallel settings of ``distframe train`` fit the world, the batch and the
model: the degrees (``--dp --tp --pp --cp``) and ``--micro-batches``. Part of TrainConfig's
validation (``config`` is a TrainConfig); each error is a ConfigError naming the flags and what to
change.
"""
from __future__ import annotations

from typing import Any

from distframe.errors import ConfigError


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


def check_divides(value: int, divisor: int, what: str, by: str) -> None:
    if value % divisor:
        raise ConfigError(f"{what} {value} is not divisible by {by}; use a multiple of {divisor}")
