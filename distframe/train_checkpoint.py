"""Where ``distframe train`` keeps its checkpoints (``OUT/checkpoints/step-N``, the sharded
format of ``distframe.checkpoint``) and how it finds the one to resume from.

Only complete checkpoints count: ``distframe.checkpoint.save`` writes into a temporary
directory and renames it into place, so an interrupted save leaves no new ``step-N`` (and a
re-save of step N that dies between its renames leaves the old one moved aside, where
``distframe.checkpoint.complete_checkpoints`` finds it).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from distframe.errors import ConfigError


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def step_path(out_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(out_dir), f"step-{step}")


def latest_checkpoint(out_dir: str) -> tuple[str, int] | None:
    """The complete checkpoint with the highest step under ``OUT/checkpoints``, or None (a
    step whose save died between its renames counts under the name it was moved aside to)."""
    from distframe.checkpoint import latest_step
    found = latest_step(checkpoint_dir(out_dir))
    return (str(found[0]), found[1]) if found else None


def agreed_latest_checkpoint(out_dir: str, backend: Any) -> tuple[str, int]:
    """``latest_checkpoint`` for ``--resume``, the same on every rank, or the same ConfigError on
    every rank (one all_gather of one int64): a rank that finds none, or another step than its
    peers (node-local directories out of step), would otherwise leave the others waiting in the
    load's collectives, or end while they train."""
    found = latest_checkpoint(out_dir)
    steps = backend.all_gather(torch.tensor([found[1] if found else -1], dtype=torch.int64)).tolist()
    if found is not None and len(set(steps)) == 1:
        return found
    if max(steps) < 0:
        # Under torchrun, --resume is not needed for restarts: a restarted worker continues
        # by itself (train.continue_after_restart).
        raise ConfigError(f"--resume: no checkpoint under {out_dir}/checkpoints; run without "
                          "--resume to start fresh (a run torchrun restarts continues from its "
                          "checkpoints without it), or pass the --out of the run to continue")
    by_step: dict[int, list[int]] = {}
    for rank, step in enumerate(steps):
        by_step.setdefault(step, []).append(rank)
    seen = "; ".join(f"{f'step {step}' if step >= 0 else 'none'} on rank{'s' if len(ranks) > 1 else ''} "
                     f"{_ranks(ranks)}" for step, ranks in sorted(by_step.items(), reverse=True))
    raise ConfigError(f"--resume: the ranks see different latest checkpoints under {out_dir}/checkpoints "
                      f"({seen}); give every rank the same --out (a shared file system, or a copy of "
                      "the latest checkpoint on every node)")


def _ranks(ranks: list[int]) -> str:
    """``0, 1, 2`` (the first few, then how many more)."""
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def saved_world_size(out_dir: str) -> int | None:
    """The world size that saved the latest checkpoint in ``out_dir``, or None (no checkpoint,
    or metadata the load will refuse, naming what is wrong)."""
    from distframe.checkpoint.format import CheckpointError, read_metadata
    found = latest_checkpoint(out_dir)
    try:
        world = read_metadata(Path(found[0])).get("world_size") if found else None
    except CheckpointError:
        return None
    return world if isinstance(world, int) and not isinstance(world, bool) else None


def check_resume_steps(out_dir: str, found: tuple[str, int] | None, steps: int) -> None:
    """ConfigError if ``--steps`` is below the step of ``found``, the checkpoint ``--resume``
    continues from (a run cannot train backwards)."""
    if found is not None and steps < found[1]:
        raise ConfigError(f"--steps {steps}: the run in {out_dir} already reached step {found[1]} "
                          f"({found[0]}); pass --steps above {found[1]} to train it further, or "
                          "leave out --resume to start a new run")


def resume_step(out_dir: str, steps: int) -> int | None:
    """The step ``--resume`` continues after (the latest checkpoint's), or None if there is no
    checkpoint; ConfigError if ``--steps`` is below it. What one process sees: ranks that a
    launcher started each see their own file system and agree with ``agreed_resume_step``."""
    found = latest_checkpoint(out_dir)
    check_resume_steps(out_dir, found, steps)
    return None if found is None else found[1]


def agreed_resume_step(out_dir: str, steps: int, backend: Any) -> int:
    """``resume_step`` agreed by every rank of ``backend`` (collective): the same step, or the
    same ConfigError, on every rank (also when there is no checkpoint)."""
    found = agreed_latest_checkpoint(out_dir, backend)
    check_resume_steps(out_dir, found, steps)
    return found[1]


def save(out_dir: str, step: int, model: Any, optimizer: Any, rng: Any = None,
         info: dict[str, Any] | None = None) -> str:
    """Collective: every rank writes its shard of ``OUT/checkpoints/step-N``, with its generator
    states when given ``rng`` (a ``train_rng.RankRandomState``) and, given ``info`` (the run's
    resolved configuration, ``train_loop.run_info``), that in its metadata: the checkpoint then
    says which model it holds wherever it is copied (``saved_run_info``)."""
    from distframe import checkpoint
    path = step_path(out_dir, step)
    checkpoint.save(path, model, optimizer, step=step, rank_state=None if rng is None else rng.state(),
                    rank_state_info=None if rng is None else rng.info(), info=info)
    return path


def load(path: str, model: Any, optimizer: Any, rng: Any = None) -> tuple[int, str | None]:
    """Collective: loads ``path`` into ``model`` and ``optimizer`` (re-sharding as needed) and,
    given ``rng``, this rank's generator states (or new streams where the checkpoint's cannot
    continue: see ``train_rng``); returns the step it was saved at and a note for the user, or
    None."""
    from distframe import checkpoint
    try:
        if rng is None:
            return int(checkpoint.load(path, model, optimizer)["step"]), None
        # The job restores a tensor-parallel model's dropout generators itself, with the others.
        metadata = checkpoint.load(path, model, optimizer, restore_dropout_rng=False,
                                   read_rank_state=rng.read)
    except checkpoint.CheckpointError as exc:
        damage = damaged(path)
        if damage is None:  # intact here (a model that does not fit it; another rank's copy)
            raise
        raise checkpoint.CheckpointError(_damaged_message(path, damage)) from exc
    step = int(metadata["step"])
    return step, rng.continue_from(step)


def damaged(path: str) -> str | None:
    """What is wrong with the files of checkpoint ``path`` (metadata, a shard's size or
    checksum), or None if they are intact. Reads every file: for errors only."""
    from distframe.checkpoint.format import CheckpointError, read_metadata, verify_files
    try:
        verify_files(Path(path), read_metadata(Path(path)))
    except CheckpointError as exc:
        return str(exc)
    return None


def check_intact(path: str) -> None:
    """CheckpointError, the one line ``--resume`` stops with (what is wrong, the latest intact
    checkpoint before it), if the files of checkpoint ``path`` are damaged. Reads every file."""
    from distframe.checkpoint.format import CheckpointError
    damage = damaged(path)
    if damage is not None:
        raise CheckpointError(_damaged_message(path, damage))


def _intact_before(path: str) -> tuple[int, str] | None:
    """The step and path of the latest checkpoint before ``path`` (by step, in its directory)
    whose files are intact, or None."""
    from distframe.checkpoint import complete_checkpoints
    # (a save over step-N that died between its renames left it as .step-N.old-*)
    match = re.fullmatch(r"\.?step-(\d+)(?:\.old-.+)?", os.path.basename(path))
    below = int(match.group(1)) if match else None
    earlier = []
    for name, where in complete_checkpoints(os.path.dirname(path)).items():
        found = re.fullmatch(r"step-(\d+)", name)
        if found and str(where) != path and (below is None or int(found.group(1)) < below):
            earlier.append((int(found.group(1)), str(where)))
    return next(((step, where) for step, where in sorted(earlier, reverse=True)
                 if damaged(where) is None), None)


def damaged_for_generate(path: str, damage: str) -> str:
    """The one line ``distframe generate`` stops with when checkpoint ``path`` is damaged: what is
    wrong and the latest intact checkpoint before it, to pass as --checkpoint instead."""
    intact = _intact_before(path)
    head = f"--checkpoint: checkpoint {path} is damaged ({damage.rstrip('.')})"
    if intact is None:
        return (f"{head}, and no earlier checkpoint in {os.path.dirname(path)} is intact; restore it "
                "from a copy")
    return f"{head}; {intact[1]} (step {intact[0]}) is the latest intact one: pass --checkpoint {intact[1]}"


def _damaged_message(path: str, damage: str) -> str:
    """The one line --resume stops with when its checkpoint is damaged: what is wrong, the latest
    intact checkpoint before it, and how to continue from that one.

    Why stop rather than fall back to the intact one with a warning: a damaged checkpoint is a
    disk or copy failure the user should see before more steps are trained on top of it, and a
    run that fell back would save its own step-N over the damaged one when it got there,
    deleting it (the evidence of what went wrong, and steps a backup may still restore);
    torchtitan and torch.distributed.checkpoint also raise on a checkpoint they cannot read and
    never pick another by themselves. Moving the damaged one out of OUT/checkpoints is one
    command, and keeps it."""
    intact = _intact_before(path)
    aside = os.path.join(os.path.dirname(os.path.dirname(path)), os.path.basename(path) + ".damaged")
    head = f"--resume: checkpoint {path} is damaged ({damage.rstrip('.')})"
    if intact is None:
        return (f"{head}, and no earlier checkpoint in {os.path.dirname(path)} is intact; restore it "
                "from a copy, or start a new run in another --out")
    return (f"{head}; {intact[1]} is the latest intact one: move the damaged one (and any other after "
            f"step {intact[0]}) out of {os.path.dirname(path)}, e.g. `mv {path} {aside}`, and run "
            f"--resume again to continue from step {intact[0]}")


def config_json_path(path: str) -> str:
    """``OUT/config.json`` of the run that wrote checkpoint ``path`` (``OUT/checkpoints/...``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.json")


def saved_run_info(path: str) -> tuple[dict[str, Any], str]:
    """The resolved configuration of the run that wrote checkpoint ``path``, and the file it was
    read from: the checkpoint's own metadata ("info", which ``save`` writes), so a checkpoint
    copied elsewhere, or beside another run's config.json, keeps its model; else (checkpoints
    saved before it held one, or metadata the load will refuse) ``run_info``."""
    from distframe.checkpoint.format import METADATA, CheckpointError, read_metadata
    try:
        info = read_metadata(Path(path)).get("info")
    except CheckpointError:  # consolidate names what is wrong with it
        info = None
    if isinstance(info, dict):
        return info, os.path.join(path, METADATA) + ' ("info")'
    return run_info(path), config_json_path(path)


def run_info(path: str) -> dict[str, Any]:
    """The resolved configuration (with the model shape) of the run that wrote checkpoint
    ``path``: ``OUT/config.json`` beside ``OUT/checkpoints``."""
    config = config_json_path(path)
    if not os.path.exists(config):
        raise ConfigError(f"{config} is missing: a checkpoint is read with the config.json of the "
                          "run that wrote it; keep OUT/config.json beside OUT/checkpoints")
    return read_config_json(config)


def read_config_json(path: str) -> dict[str, Any]:
    """A run's ``OUT/config.json``; ConfigError naming the file if it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise ConfigError(f"{path} cannot be read ({exc}); it holds the run's settings and model "
                          "shape: restore it from the run that wrote OUT") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds {type(raw).__name__}, not the JSON object distframe train "
                          "writes; restore it from the run that wrote OUT")
    return raw
