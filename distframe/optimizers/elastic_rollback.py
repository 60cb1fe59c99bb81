"""What ElasticOptimizer's restore says when it would go back: the error it raises, the
messages that name the steps lost and the fix (``ElasticOptimizer._restore`` decides), and the
newest checkpoint in ``checkpoint_dir``, which it goes on from where no commit is held."""
from __future__ import annotations

from pathlib import Path

from distframe.errors import DistFrameError


class ElasticRollbackError(DistFrameError, RuntimeError):
    """Restoring would silently go back behind the run's newest commit: every worker that held
    it failed, or a state loaded by hand was lost before it was committed. The message says
    which steps would be lost and what to do; ElasticController ends the run with it."""


def describe_source(commit_step: int | None, found: tuple[Path, int] | None) -> str:
    """The state a restore goes on from: a commit held, else the checkpoint found, else none."""
    if commit_step is not None:
        return f"the commit of step {commit_step}"
    if found is not None:
        return f"the checkpoint of step {found[1]} ({found[0]})"
    return "the initial state (step 0)"


def lost_commit(required: int, step: int, source: str, found: tuple[Path, int] | None,
                directory: Path | None, allow: bool) -> str:
    """Why the restore cannot reach the run's newest commit (of step ``required``) and goes on
    from ``source`` (of ``step``), and (unless ``allow``) what to do."""
    where = (f"the newest checkpoint is of step {found[1]}" if found is not None
             else f"there is no checkpoint in checkpoint_dir={str(directory)!r}" if directory is not None
             else "there is no checkpoint_dir")
    what = (f"no worker of this group holds the commit of step {required}, the run's newest (every "
            f"worker that held it failed), and {where}")
    lost = _steps(step + 1, required)
    if allow:
        return f"{what}: {lost} lost; going on from {source}"
    restart = f"restart from the checkpoint of step {found[1]} ({found[0]}), " if found is not None else ""
    return (f"{what}: going on from {source} would silently lose {lost}. Set checkpoint_dir= and "
            f"checkpoint_every= so that checkpoints back the commits, {restart}or pass "
            f"allow_rollback=True to every worker's ElasticOptimizer to go on from step {step} with "
            "a warning")


def unsaved_load(loaded: int, source: str, allow: bool) -> str:
    """Why the restore would drop a state loaded by hand (at step ``loaded``) that no commit
    holds yet, and (unless ``allow``) what to do."""
    what = (f"a state loaded by hand at step {loaded} (checkpoint.load or load_state_dict) was not "
            "committed yet when its group ended (a worker failed, or the membership changed, "
            "before the first step() after the load, which commits it)")
    if allow:
        return f"{what}: it is lost; going on from {source}"
    return (f"{what}: going on from {source} would silently drop it. Load it again and call "
            "commit() right after loading, or pass allow_rollback=True to every worker's "
            f"ElasticOptimizer to go on from {source} with a warning")


def latest_checkpoint(directory: Path | None) -> Path | None:
    """The ``step-N`` checkpoint with the largest N in ``directory`` (complete ones only)."""
    found = latest_checkpoint_and_step(directory)
    return found[0] if found else None


def latest_checkpoint_and_step(directory: Path | None) -> tuple[Path, int] | None:
    """``latest_checkpoint(directory)`` and its N, or None."""
    from distframe.checkpoint import latest_step
    return None if directory is None else latest_step(directory)


def _steps(first: int, last: int) -> str:
    return f"step {last}" if first == last else f"steps {first} to {last}"
