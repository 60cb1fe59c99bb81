"""init_backend called more than once in a process under torchrun: each call is a group of its own.

Run as a module under torchrun, this file is the program of that launch test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distframe.launch import init_backend

pytestmark = pytest.mark.gloo
REPO_ROOT = Path(__file__).resolve().parents[2]


def torchrun_main() -> None:
    """Two live groups, then a third after both are shut down; each sums its own values."""
    first = init_backend("gloo", timeout=30)
    second = init_backend("gloo", timeout=30)
    rank = first.rank
    a = second.all_reduce(torch.tensor([10.0 * (rank + 1)]))
    b = first.all_reduce(torch.tensor([float(rank + 1)]))
    second.shutdown()
    first.shutdown()
    with init_backend("gloo", timeout=30) as third:
        c = third.all_gather(torch.tensor([100.0 * (rank + 1)]))
    print(f"RESULT {rank} {a.item()} {b.item()} {c.tolist()}", flush=True)


def test_init_backend_twice_under_torchrun_gives_independent_groups():
    # Before each call had keys of its own, the second group read the first's Gloo addresses
    # from the store and failed with "connectFullMesh ... Connect timeout" at its timeout.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.backends.test_init_backend_twice"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    values = [np.array([1.0, 2.0]), np.array([10.0, 20.0]), np.array([100.0, 200.0])]
    expected = sorted(f"RESULT {r} {values[1].sum()} {values[0].sum()} {values[2].tolist()}"
                      for r in range(2))
    assert sorted(re.findall(r"RESULT \d [\d.]+ [\d.]+ \[[\d., ]+\]", done.stdout)) == expected


if __name__ == "__main__":
    torchrun_main()
