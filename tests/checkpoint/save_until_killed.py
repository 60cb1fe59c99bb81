"""``python -m tests.checkpoint.save_until_killed PATH``: a process that saves a checkpoint at PATH
and stops inside the write of its shard file, a partial file on disk, after printing ``writing``:
a save to kill midway (SIGKILL) or to keep alive as another job's save in progress."""
import sys
import time

import safetensors.torch

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import STRATEGIES, build_model


def _stalls(tensors, filename, *args, **kwargs):
    with open(filename, "wb") as f:
        f.write(b"\0" * 64)  # the first bytes of the shard; the rest never comes
    print("writing", flush=True)
    while True:
        time.sleep(60)


def main(path: str) -> None:
    safetensors.torch.save_file = _stalls  # this process only
    spawn(lambda b: checkpoint.save(path, STRATEGIES["ddp"][0](build_model(), b), step=1), 1)


if __name__ == "__main__":
    main(sys.argv[1])
