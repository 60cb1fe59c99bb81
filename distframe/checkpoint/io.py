"""save / load / consolidate of sharded checkpoints.

save (collective): rank 0 picks a temporary directory name and broadcasts it; every rank records
itself there as a writer (``temporary``), then writes its safetensors file there and hashes
it; one all_gather of each rank's file table (as JSON bytes, or the rank's error) brings them to
every rank, which all raise if any rank failed to write (each removes its temporary directory).
Otherwise rank 0 checks that it sees every rank's file (``tables``: the ranks may not have saved
to one directory), writes metadata.json last and renames the directory into place (an existing
checkpoint at the same path is moved aside first and deleted after, or moved back if the rename
fails), and one ``agree`` (one all_gather, where a barrier would otherwise be) tells every rank
whether that worked (each rank removes its temporary directory if not). A save that fails or
dies midway leaves the previous checkpoint intact, under its own name or, if the save died
between its two renames, under the name it was moved aside to, where ``load`` and
``complete_checkpoints`` still find it. Rank 0 of a save that
completes then removes the temporary directories that saves of any name which died left in the
same parent directory, but not one whose save another process may still be writing
(``temporary``'s note says which).

load: every rank checks every file's size and checksum before touching the model, then reads the
parameter ranges its new layout holds (``read_shards``), all without communication; one ``agree``
then tells every rank whether every rank got that far (see ``agreement``), before the strategy's
collective ``finish_load``.
"""
from __future__ import annotations

import glob
import json
import numbers
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from distframe.backends.objects import all_gather_bytes
from distframe.backends.protocol import ICommunicationBackend
from distframe.checkpoint.agreement import agree, describe_error, failure
from distframe.checkpoint import complex_views, dropout_rng, tables, temporary
from distframe.checkpoint.matching import check_parameters
from distframe.checkpoint.format import (FORMAT_VERSION, METADATA, SHARD_FILE, CheckpointError,
                                         fsync_path, open_reader, read_metadata, sha256_of,
                                         shard_file_name, untied_aliases, verify_files,
                                         write_metadata)
from distframe.errors import ConfigError
from distframe.models.base import ShardedModelBase
from distframe.models.sharded_state import RangeReader, numel_of, piece_key
from distframe.optimizers.sharded_state import (check_state_outside_model, hyperparameters,
                                                load_optimizer_pieces, optimizer_pieces)
from distframe.checkpoint.tables import RANK_STATE


def save(path: str | Path, model: ShardedModelBase, optimizer: Any = None, *, step: int | None = None,
         rank_state: Mapping[str, torch.Tensor] | None = None,
         rank_state_info: Any = None, info: Mapping[str, Any] | None = None) -> Path:
    """Writes ``model`` (and ``optimizer``'s) sharded state to directory ``path``; collective.
    If any rank's part fails, every rank raises (naming it) and ``path``'s previous checkpoint,
    if any, stays. ``rank_state``: tensors of this rank's own (a training job's generator
    states), stored whole as ``rank_state/<name>@0``, so names must differ between ranks;
    ``rank_state_info`` (rank 0's, JSON) goes into the metadata under ``rank_state``, and
    ``info`` (rank 0's JSON object: what the checkpoint is of, such as the model's configuration)
    under ``info``, inside the same atomic save and checksum as the tensors."""
    _check_model(model)
    step = _whole_step(step)
    backend, path = model.backend, Path(path)
    tmp = path.parent / temporary.temporary_name(path.name, _agree_token(backend))
    table: dict[str, Any] | None = None
    error: Exception | None = None
    opt_state: dict[str, Any] = {}
    try:
        if backend.rank == 0:  # the rank that replaces what is at ``path``
            _check_target(path)
        table, opt_state = _write_shard(tmp, path, model, optimizer, rank_state or {})
    except Exception as exc:  # noqa: BLE001 - every rank raises it, below
        error = exc
    # The file tables' all_gather tells every rank whether every rank wrote its file.
    if error is not None:
        table = {"error": describe_error(error), "setting": isinstance(error, ConfigError)}
    file_tables = _all_gather_json(backend, table)
    reasons = {rank: t["error"] for rank, t in enumerate(file_tables) if "error" in t}
    if reasons:
        # Every rank is done writing; each removes its own directory (ranks may not share one).
        shutil.rmtree(tmp, ignore_errors=True)
        setting = all(file_tables[rank]["setting"] for rank in reasons)
        raise failure(f"saving checkpoint {path}", reasons, backend.world_size, setting=setting) from error
    try:
        if backend.rank == 0:
            tables.check_shared_directory(tmp, file_tables)  # [Note: one directory for every rank]
            tables.check_rank_state(file_tables)
            meta = _metadata(model, optimizer, opt_state, file_tables, step)
            meta["rank_state"] = rank_state_info
            if info is not None:
                meta["info"] = dict(info)
            write_metadata(tmp, meta)
            _rename_into_place(tmp, path)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    try:
        agree(backend, error, f"saving checkpoint {path}")  # in place of a barrier: no more cost
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # each rank its own: nothing was committed from it
        raise
    return path


def _check_target(path: Path) -> None:
    """ConfigError unless ``path`` is absent, an empty directory or a checkpoint: save replaces
    what is there, so a file or a directory of other things would be deleted without a word."""
    if path.name in ("", ".", ".."):
        raise ConfigError(f"cannot save a checkpoint as {str(path)!r}: name the directory to create, "
                          f"e.g. {str(path / 'checkpoint')!r}")
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, and saving a checkpoint there would replace it: "
                          "choose another path or remove the file")
    others = sorted(p.name for p in path.iterdir() if p.name != METADATA and not
                    SHARD_FILE.fullmatch(p.name) and not temporary.WRITER_RECORD.fullmatch(p.name))
    if others:
        raise ConfigError(f"{path} is a directory that is not a checkpoint (it holds {others[:3]}"
                          f"{'...' if len(others) > 3 else ''}), and saving a checkpoint there would "
                          "delete it: choose another path")


def _write_shard(tmp: Path, path: Path, model: ShardedModelBase, optimizer: Any,
                 rank_state: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's safetensors file in ``tmp`` (made by whichever rank comes first); its file
    table for the metadata (with what ``tables`` takes out of it first: its optimizer's param
    groups, and the path it saves to), and the optimizer state the metadata takes from rank 0's."""
    tensors = dict(model.state_dict())
    opt_state = _optimizer_state(model, optimizer)
    tensors.update(opt_state.pop("tensors", {}))
    tensors.update(dropout_rng.pieces(model))
    tensors.update({piece_key(RANK_STATE, name, 0): value.reshape(-1) for name, value in rank_state.items()})
    file = tmp / shard_file_name(model.backend.rank, model.backend.world_size)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        temporary.write_writer_record(tmp, model.backend.rank)  # before the shard: see temporary
        stored, file_metadata = complex_views.stored_form(tensors)  # safetensors has no complex dtypes
        safetensors.torch.save_file(stored, str(file), metadata=file_metadata)
        fsync_path(file)
    except (OSError, safetensors.SafetensorError) as exc:  # a full disk, no permission: the place
        raise ConfigError(f"cannot write its files in {tmp.parent} ({exc}): free space there, fix its "
                          "permissions, or save to another directory") from exc
    table = {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256_of(file),
             "tensors": {k: v.numel() for k, v in tensors.items()},
             "scalars": opt_state.pop("scalars", {}), "param_groups": opt_state.pop("param_groups", None),
             "path": os.path.abspath(path), dropout_rng.KIND: dropout_rng.layout(model)}
    return table, opt_state


def load(path: str | Path, model: ShardedModelBase, optimizer: Any = None, *,
         restore_dropout_rng: bool = True,
         read_rank_state: Callable[[dict[str, Any], RangeReader], None] | None = None) -> dict[str, Any]:
    """Loads a checkpoint saved under any data-parallel strategy and world size into ``model``
    (and ``optimizer``); returns its metadata (``meta["step"]``). Collective. If any rank's
    part fails, every rank raises (naming it); the model's state is then undefined: load again.
    A tensor-parallel model also gets its dropout generators back (``checkpoint.dropout_rng``;
    ``restore_dropout_rng=False`` keeps its own). ``read_rank_state(meta, reader)`` is called on
    every rank before the ranks agree, so its errors stop every rank; it reads what ``save``'s
    ``rank_state`` stored with ``reader.whole("rank_state", name)`` (or ``reader.wholes``)."""
    _check_model(model)
    meta: dict[str, Any] = {}
    error: Exception | None = None
    try:
        meta = _load_locally(Path(path), model, optimizer, restore_dropout_rng, read_rank_state)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    agree(model.backend, error, f"loading checkpoint {path}", meta if error is None else None)
    model.finish_load()
    finish = getattr(optimizer, "finish_load", None)  # an ElasticOptimizer commits what it loaded
    if finish is not None:
        finish()
    return meta


def _load_locally(path: Path, model: ShardedModelBase, optimizer: Any, restore_dropout_rng: bool,
                  read_rank_state: Callable[[dict[str, Any], RangeReader], None] | None) -> dict[str, Any]:
    """Every step of ``load`` that needs no communication: checks, then this rank's reads."""
    path = _existing(path)
    meta = read_metadata(path)
    verify_files(path, meta, checksums=False)  # sizes here; each file's sha256 when first read
    ours = set(model.parameter_metadata()) | {name for name, _ in model.replicated_tensors()}
    untied = untied_aliases(meta, ours)
    reader = open_reader(path, meta, untied, verify=True)
    check_parameters(meta, model, untied, reader)
    try:
        model.read_shards(reader)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise CheckpointError(f"{path / METADATA} holds no optimizer state; load without an optimizer")
        _check_optimizer_class(meta["optimizer"].get("class"), optimizer)
        # The checkpoint's step, unless the optimizer saved its own count (an ElasticOptimizer
        # loading a plain optimizer's checkpoint resumes at its step, as its restore does).
        state = {"step_count": meta.get("step"), **meta["optimizer"].get("extra", {}), "tensors": {},
                 "scalars": meta["optimizer"]["scalars"], "param_groups": meta["optimizer"]["param_groups"]}
        if hasattr(optimizer, "wrapped_optimizer"):
            model.check_optimizer(optimizer)
            optimizer.load_state_dict(state, reader)
        else:
            check_state_outside_model(optimizer, model.parameters(), saving=False)
            load_optimizer_pieces(model.shard_layout(), optimizer, reader, state["scalars"],
                                  state["param_groups"])
    dropout_rng.restore(path, meta, reader, model, enabled=restore_dropout_rng)
    if read_rank_state is not None:
        read_rank_state(meta, reader)
    return meta


def consolidate(path: str | Path) -> dict[str, torch.Tensor]:
    """The full state dict (parameters, frozen parameters, buffers; a tied weight under each of
    its names) of the checkpoint at ``path``, for single-process use. Reads every file; no
    communication."""
    path = _existing(Path(path))
    meta = read_metadata(path)
    verify_files(path, meta)
    reader = open_reader(path, meta)
    out: dict[str, torch.Tensor] = {}
    for name, info in meta["parameters"].items():
        numel = numel_of(info["shape"])
        if numel == 0:  # no rank stores a piece of a parameter without elements
            dtype = getattr(torch, str(info.get("dtype")), None)
            out[name] = torch.empty(info["shape"], dtype=dtype if isinstance(dtype, torch.dtype) else None)
            continue
        out[name] = reader.read("param", name, 0, numel).reshape(info["shape"]).clone()
    for name in meta["replicated"]:
        out[name] = reader.buffer(name).clone()
    # A tied weight is stored once; the unwrapped model's state_dict() has it under every name.
    for alias, name in meta.get("aliases", {}).items():
        if name in out:
            out[alias] = out[name]
    return out


# ---- helpers -----------------------------------------------------------------------------------
def _check_model(model: Any) -> None:
    if not isinstance(model, ShardedModelBase):
        raise ConfigError(f"checkpoints hold sharded models: pass the wrapped model (DDPModel, "
                          f"ZeRO3Model, ...), got {type(model).__name__}; for a plain module in one "
                          "process, use module.load_state_dict(distframe.checkpoint.consolidate(path))")


def _whole_step(step: Any) -> int | None:
    """``step`` as an int (numpy's and 0-d tensors' too, which JSON cannot write), before any rank
    writes; ConfigError for anything that is not a whole number."""
    if step is None:
        return None
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)
    raise ConfigError(f"checkpoint.save: step must be a whole number (the training step) or None, "
                      f"got {step!r}")


def _check_optimizer_class(saved: Any, optimizer: Any) -> None:
    """ConfigError unless ``optimizer`` is of the torch optimizer class the checkpoint's state
    belongs to (or a subclass of it): another class's state loaded without a word (Adam's
    moments into SGD, which dropped them) or failed inside torch (SGD's momentum into Adam:
    KeyError 'step')."""
    ours = type(getattr(optimizer, "wrapped_optimizer", optimizer))
    if saved is None or saved in {cls.__name__ for cls in ours.__mro__}:
        return
    raise ConfigError(f"the checkpoint holds the optimizer state of {saved}, not of {ours.__name__}: "
                      f"build the optimizer with {saved} as the saved run did, or load the model "
                      "without the optimizer")


def _optimizer_state(model: ShardedModelBase, optimizer: Any) -> dict[str, Any]:
    if optimizer is None:
        return {}
    if hasattr(optimizer, "wrapped_optimizer"):
        model.check_optimizer(optimizer)
        return dict(optimizer.state_dict())
    model.check_optimizer(optimizer)
    check_state_outside_model(optimizer, model.parameters(), saving=True)  # before any writes
    b = model.backend
    layout = model.shard_layout()
    tensors, scalars = optimizer_pieces(layout, optimizer, b.rank, b.world_size)
    return {"tensors": tensors, "scalars": scalars, "param_groups": hyperparameters(optimizer, layout)}


def _agree_token(backend: ICommunicationBackend) -> str:
    # From the OS, not Python's global random: a save must not move the caller's random stream
    # (on rank 0 only), and a seeded run must not reuse a dead save's temporary directory.
    token = torch.tensor([int.from_bytes(os.urandom(6), "little") if backend.rank == 0 else 0],
                         dtype=torch.int64)
    backend.broadcast(token, 0)
    return f"{int(token):012x}"


def _all_gather_json(backend: ICommunicationBackend, obj: Any) -> list[Any]:
    return [json.loads(blob) for blob in all_gather_bytes(backend, json.dumps(obj).encode())]


def _metadata(model: ShardedModelBase, optimizer: Any, opt_state: dict[str, Any],
              file_tables: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
    scalars: dict[str, Any] = {}
    for table in file_tables:
        scalars.update(table.pop("scalars"))
        table.pop("path")
    param_groups = tables.merged_param_groups(file_tables)  # [Note: every stage's param groups]
    rng_layout = dropout_rng.agreed_layout(file_tables)  # rank 0's stage may hold no generators
    return {
        "format_version": FORMAT_VERSION, "strategy": type(model).__name__,
        "world_size": model.backend.world_size, "step": step,
        "parameters": model.parameter_metadata(),
        # What the ranks stored (a pipeline's stages each store their own buffers).
        "replicated": sorted({k.removeprefix("buffer/") for t in file_tables for k in t["tensors"]
                              if k.startswith("buffer/")}),
        "aliases": model.state_aliases(),
        "files": file_tables,
        "dropout_rng": rng_layout,
        "optimizer": None if optimizer is None else {
            "class": type(getattr(optimizer, "wrapped_optimizer", optimizer)).__name__,
            "param_groups": param_groups, "scalars": scalars,
            # What else the optimizer's state_dict holds (JSON, the same on every rank: an
            # ElasticOptimizer's scheduler state and step count), handed back to its load.
            "extra": opt_state},
    }


def _rename_into_place(tmp: Path, path: Path) -> None:
    old = None
    if path.exists() or path.is_symlink():  # a link, even to nothing, is replaced as a checkpoint is
        old = path.parent / f".{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
        path.rename(old)
    try:
        tmp.rename(path)
    except OSError:
        if old is not None:  # the previous checkpoint back under its own name
            old.rename(path)
        raise
    temporary.drop_writer_records(path)
    # Also what saves that died left: had one over ``path`` died between the two renames, the
    # checkpoint it had moved aside, and the temporary directories of any name no one writes.
    for stale in list(path.parent.iterdir()):
        if stale.name.startswith(f".{path.name}.old-"):  # a checkpoint, or a link to one
            tables.remove(stale)
    temporary.remove_abandoned(path.parent)


def latest_step(directory: str | Path) -> tuple[Path, int] | None:
    """The complete ``step-N`` checkpoint in ``directory`` with the largest N, and N; or None."""
    found = [(int(m.group(1)), path) for name, path in complete_checkpoints(directory).items()
             if (m := re.fullmatch(r"step-(\d+)", name))]
    if not found:
        return None
    step, path = max(found)
    return path, step


def complete_checkpoints(directory: str | Path) -> dict[str, Path]:
    """Every complete checkpoint in ``directory`` (one holding metadata.json), by the name it was
    saved under: ``NAME`` itself or, where a save over NAME died between its two renames, the
    checkpoint it had moved aside (``.NAME.old-*``). ``load`` and ``consolidate`` of NAME read
    the same one."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found: dict[str, Path] = {}
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") and ".old-" in name:
            name = name[1:].rsplit(".old-", 1)[0]
        elif name.startswith("."):
            continue
        complete = _complete(directory / name)
        if complete is not None:
            found[name] = complete
    return found


def _complete(path: Path) -> Path | None:
    """``path`` if it is a complete checkpoint, else the complete one a save over ``path``
    moved aside before it died, else None."""
    if (path / METADATA).is_file():
        return path
    aside = sorted(p for p in path.parent.glob(f".{glob.escape(path.name)}.old-*")
                   if (p / METADATA).is_file())
    return aside[-1] if aside else None


def _existing(path: Path) -> Path:
    """``path``, or the complete checkpoint a save over ``path`` moved aside before it died."""
    if path.exists():
        return path
    return _complete(path) or path
