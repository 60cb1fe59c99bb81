"""A torchrun script that raises: its peers learn that it failed (RankFailedError naming it), not
that it returned. The interpreter does not run the thread that departs for a script's end after
an uncaught exception, so the exit handler departed instead, as if the script had returned, and
the waiting peer got a CollectiveTimeoutError saying rank 1 "left ... (its function returned)".

Run as a module under torchrun, this file is the program of the test."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def torchrun_main() -> None:
    from distframe import init_backend
    backend = init_backend("gloo", timeout=30)
    backend.barrier()
    if backend.rank == 1:
        time.sleep(0.5)
        raise RuntimeError("the script of rank 1 failed")
    started = time.monotonic()
    try:
        backend.all_reduce(torch.ones(2))
        outcome = "completed"
    except Exception as exc:  # noqa: BLE001 - the test reads what rank 0 got
        outcome = type(exc).__name__
    print(f"OUTCOME {outcome} {time.monotonic() - started:.2f}", flush=True)


@pytest.mark.gloo
def test_a_script_that_raises_under_torchrun_stops_its_peer_with_rank_failed_error():
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.test_launch_script_raises"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0  # rank 1 failed, and torchrun says so
    found = re.findall(r"OUTCOME (\w+) ([\d.]+)", done.stdout)
    assert len(found) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    outcome, elapsed = found[0]
    assert outcome == "RankFailedError", done.stdout[-3000:]
    assert float(elapsed) < 10  # at once, not at the 30 s timeout


if __name__ == "__main__":
    torchrun_main()
