"""The ranks of one pipeline agree, at the start of each training step, that they were given one batch.

[Note: one batch per pipeline] ``train_step``'s batch is this rank's data-parallel slice, the same
on every rank of a pipeline: the first stage cuts its inputs into micro-batches, the last stage
its targets, and the last pairs micro-batch i of the one with micro-batch i of the other. The DDP
habit (each rank slicing the global batch by its own rank) gave the ranks of one pipeline
different slices, and the last stage paired rank 0's inputs with its own targets: with slices of
one size a loss of neither slice, silently; with slices of different sizes torch's broadcasting
warning and a wrong loss, or its shape error, which named no mistake. So a step starts with one
all_gather over the pipeline group of six integers per rank: the rows of the first stage's
inputs and of the last stage's targets (or that the rank's own check refused them: its peers
then stop at once with RankFailedError instead of waiting for its activations), and under
``debug=True`` a hash of every rank's inputs and targets. Every rank then raises the same
ConfigError. The sizes cost that one small collective; comparing contents reads the whole batch
on the host, which a step does not otherwise pay, so same-size slices of different contents are
found in debug mode only. A rank may pass None for the part it does not use (the first stage's
targets, the last stage's inputs): it is compared with nothing. Targets of a whole multiple of
the inputs' rows (token targets flattened to batch x length rows) pass, as before: their
micro-batches still pair with the inputs' row for row, cut alike along dim 0.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError, RankFailedError

_UNUSED = -1  # the rows of a part this rank does not cut (only the first stage cuts inputs)
_REFUSED = -2  # the rank's own check refused that part: it raises its own error
_FIX = ("Every rank of a pipeline passes the same batch: its data-parallel slice (the whole batch "
        "without data parallelism), not a slice of its own per rank as under DDP; slice the global "
        "batch by model.data_parallel_coordinates() (dp, dp_index), not by rank")


def check_one_batch(group: ICommunicationBackend, inputs: Any, targets: Any, *,
                    refused: ConfigError | None, device: torch.device) -> None:
    """Collective over the pipeline ``group``: ConfigError on every rank unless the first stage's
    inputs and the last stage's targets have the same rows (under ``debug``: unless every rank
    was given the same inputs and targets). ``refused``: this rank's own error about its part of
    the batch (cutting it into micro-batches failed), raised here after the collective."""
    first, last = group.rank == 0, group.rank == group.world_size - 1
    debug = bool(getattr(group, "debug", False))
    mine = [_rows(inputs, first, refused), _rows(targets, last, refused),
            *_digest(inputs, debug), *_digest(targets, debug)]
    table = group.all_gather(torch.tensor(mine, dtype=torch.int64, device=device))
    table = table.reshape(group.world_size, len(mine)).tolist()
    if refused is not None:
        raise refused
    for rank, row in enumerate(table):
        for what, rows in zip(("inputs", "targets"), row[:2]):
            if rows == _REFUSED:
                raise RankFailedError(None, f"pipeline rank {rank} refused its {what} for this step (its "
                                            "ConfigError says why), so every rank of the pipeline stops")
    input_rows, target_rows = table[0][0], table[-1][1]
    if input_rows != target_rows and not (input_rows > 0 and target_rows % input_rows == 0):
        raise ConfigError(
            f"the ranks of this pipeline were given different batches: its first stage (pipeline rank 0) "
            f"cuts inputs of {input_rows} rows into micro-batches and its last (pipeline rank "
            f"{group.world_size - 1}) targets of {target_rows} rows, pairing micro-batch i of the one "
            f"with micro-batch i of the other (targets have the inputs' rows along dim 0, or a whole "
            f"multiple of them when flattened). {_FIX}")
    if debug:
        _compare_contents(table)


def _compare_contents(table: list[list[int]]) -> None:
    for what, column in (("inputs", 2), ("targets", 4)):
        given = [(rank, row[column + 1]) for rank, row in enumerate(table) if row[column]]
        for rank, digest in given[1:]:
            if digest != given[0][1]:
                raise ConfigError(
                    f"pipeline ranks {given[0][0]} and {rank} were given different {what} of one size "
                    f"(debug=True compares every rank's batch), so the last stage would pair the first "
                    f"stage's inputs with targets of another slice (a placeholder for a part a stage "
                    f"does not use differs too: pass None for it). {_FIX}")


def _rows(part: Any, cut_here: bool, refused: ConfigError | None) -> int:
    if not cut_here:
        return _UNUSED
    return _REFUSED if refused is not None else int(part.shape[0])


def _digest(part: Any, debug: bool) -> tuple[int, int]:
    """``(1, hash)`` of a tensor's dtype, shape and bytes in debug mode, else ``(0, 0)``."""
    if not debug or not isinstance(part, torch.Tensor):
        return 0, 0
    data = part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(f"{part.dtype} {tuple(part.shape)}".encode(), digest_size=8)
    digest.update(data)
    return 1, int.from_bytes(digest.digest(), "little", signed=True)
