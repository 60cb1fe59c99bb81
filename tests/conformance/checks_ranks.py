"""Conformance checks of how ranks, tags and chunks may be given. Ranks and tags: any exact
integer (a NumPy integer, a 0-dim integer tensor), as torch.distributed takes them; never a bool
or a float. Chunks: strided views arrive contiguous."""
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


def check_strided_chunks_arrive_contiguous(backend) -> None:
    """scatter, all_to_all and gather of transposed views: each rank receives contiguous tensors
    holding the views' values (NumPy oracle), on every engine."""
    n, r = backend.world_size, backend.rank
    base = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * j for j in range(n)]
    views = [torch.from_numpy(b.copy()).t() for b in base]
    got = backend.scatter(views if r == 0 else None, 0)
    exchanged = backend.all_to_all([torch.from_numpy(base[r].copy()).t() for _ in range(n)])
    gathered = backend.gather(views[r], 0)
    received = [got, *exchanged, *(gathered or [])]
    if not all(t.is_contiguous() for t in received):
        raise AssertionError("received chunks must be contiguous, as on every engine")
    np.testing.assert_array_equal(got.view(-1).numpy(), base[r].T.reshape(-1))
    for j, t in enumerate(exchanged):
        np.testing.assert_array_equal(t.view(-1).numpy(), base[j].T.reshape(-1))
    for j, t in enumerate(gathered or []):
        np.testing.assert_array_equal(t.numpy(), base[j].T)
