"""Conformance check of how ranks and tags may be given: any exact integer (a NumPy integer, a
0-dim integer tensor), as torch.distributed takes them; never a bool or a float."""
from __future__ import annotations

import numpy as np
import pytest
import torch


def check_integer_like_ranks_and_tags(backend) -> None:
    n, r = backend.world_size, backend.rank
    last = n - 1
    for src in (np.int64(last), torch.tensor(last)):
        # Before, these were "out of range for a group of world_size n", which they are not.
        got = backend.broadcast(torch.tensor([float(r)]), src)
        np.testing.assert_array_equal(got.numpy(), [float(last)])
    gathered = backend.gather(torch.tensor([float(r)]), np.int32(0))
    if r == 0:
        np.testing.assert_array_equal(torch.cat(gathered).numpy(), np.arange(n, dtype=np.float32))
    group = backend.new_group(np.arange(n)[::-1])
    if group.rank != n - 1 - r:
        raise AssertionError(f"new_group(numpy ranks): rank {r} became {group.rank}")
    if n > 1:
        peer = np.int64((r + 1) % n)
        backend.send(torch.tensor([float(r)]), peer, tag=np.int16(3))
        got = backend.recv(torch.zeros(1), np.int64((r - 1) % n), tag=torch.tensor(3))
        np.testing.assert_array_equal(got.numpy(), [float((r - 1) % n)])
    for bad in (True, 0.0, "0"):
        with pytest.raises(ValueError, match="must be an int"):
            backend.broadcast(torch.zeros(1), bad)
    with pytest.raises(ValueError, match="must be an int"):
        backend.new_group([True] if n == 1 else [0, True])
    group.shutdown()
