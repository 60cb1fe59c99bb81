"""Conformance check of a receive whose message has another size: the error is the receive's
outcome, raised by every wait, on every engine that checks sizes (in-memory, MPI; Gloo and NCCL
check them with debug=True)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from distframe.errors import CollectiveMismatchError


def check_a_mismatched_receive_raises_on_every_wait(backend) -> None:
    n, r = backend.world_size, backend.rank
    if n > 1 and r == 0:
        backend.send(torch.arange(4.0), 1)
        backend.send(torch.arange(3.0) + 10, 1)
    elif n > 1 and r == 1:
        work = backend.irecv(torch.zeros(3), 0)
        for _ in range(2):  # before: in-memory waited out its timeout, MPI said "sent 0 bytes"
            sent = r"rank 0 sent (shape \(4,\)|more than 12 bytes)"
            with pytest.raises(CollectiveMismatchError, match=sent):
                work.wait(timeout=30)
        if not work.is_completed():
            raise AssertionError("a receive that failed has completed")
        got = backend.recv(torch.zeros(3), 0)  # the next message on the channel is unaffected
        np.testing.assert_array_equal(got.numpy(), np.arange(3, dtype=np.float32) + 10)
    backend.barrier()
