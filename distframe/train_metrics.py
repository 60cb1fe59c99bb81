"""What a training run shows and leaves on rank 0: the progress bar, ``OUT/metrics.jsonl``,
``OUT/loss.png`` and peak memory.

``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated`` on a GPU and, on CPU, the peak
resident set size of the process (``resource.getrusage``; in-memory ranks are threads of one
process, so there it covers all of them).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
from typing import Any

import torch

from distframe.errors import ConfigError
from distframe.train_out import cannot_write

METRIC_KEYS = ("step", "train_loss", "val_loss", "tokens_per_s", "peak_memory_bytes", "wall_s")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


class MetricsLog:
    """Appends one JSON object per logged step to ``OUT/metrics.jsonl`` (flushed each time). An
    OSError (a full disk, a directory in its place) is a ConfigError naming the file."""

    def __init__(self, out_dir: str) -> None:
        self.out = out_dir
        self.path = os.path.join(out_dir, "metrics.jsonl")

    def records(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except OSError as exc:
            raise ConfigError(f"--out {self.out}: cannot read {self.path} ({exc.strerror or exc}); "
                              "move it away (it only holds the logged metrics)") from None
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines):  # no newline after it: a write cut short by a crash
                    break
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ConfigError(f"{self.path} line {number} is not a metrics record; delete that "
                                  "line (or the file, which only holds the logged metrics)")
            records.append(record)
        return records

    def keep_until(self, step: int) -> list[dict[str, Any]]:
        """Drops records after ``step`` (written after the checkpoint a run resumes from)."""
        kept = [r for r in self.records() if r["step"] <= step]
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        except OSError as exc:
            raise cannot_write(self.out, self.path, exc) from None
        return kept

    def clear(self) -> None:
        try:
            if os.path.lexists(self.path):
                os.remove(self.path)
        except OSError as exc:
            raise cannot_write(self.out, self.path, exc) from None

    def append(self, record: dict[str, Any]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({k: record[k] for k in METRIC_KEYS}) + "\n")
        except OSError as exc:
            raise cannot_write(self.out, self.path, exc) from None


class ProgressBar:
    """tqdm on rank 0 (step, loss, tokens/s, memory); nothing on the other ranks."""

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm
            if multiprocessing.parent_process() is not None:
                # A rank process distframe started (spawn or forkserver): tqdm's default lock
                # there is a named semaphore registered with the parent's resource tracker, which
                # reports it "leaked" when Ctrl-C stops the rank. One thread writes this bar.
                tqdm.set_lock(threading.RLock())
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict[str, Any], steps: int = 1) -> None:
        """Shows ``record`` and moves the bar ``steps`` on (not past its total)."""
        if self._bar is None:
            return
        postfix = {"loss": f"{record['train_loss']:.3f}"}
        if record["val_loss"] is not None:
            postfix["val"] = f"{record['val_loss']:.3f}"
        postfix["tok/s"] = f"{record['tokens_per_s']:.0f}"
        postfix["mem"] = format_bytes(record["peak_memory_bytes"])
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(min(steps, self._bar.total - self._bar.n))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plot_losses(records: list[dict[str, Any]], path: str) -> str | None:
    """Writes train and validation loss against step to ``path``; returns None, or a line that
    says how to get the plot when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("no loss plot: matplotlib is not installed; `pip install 'distframe[plot]'` "
                "(or `pip install matplotlib`) and run again to get it")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["train_loss"] for r in records], label="train",
            linewidth=1)
    evaluated = [r for r in records if r["val_loss"] is not None]
    ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-",
            label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:  # the run's metrics and checkpoints are written: only the plot is lost
        return f"no loss plot: cannot write {path} ({exc.strerror or exc}); metrics.jsonl holds the losses"
    finally:
        plt.close(fig)
    return None
