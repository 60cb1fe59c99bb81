"""``debug=True`` on the in-memory engine: the signature exchange before each call is named as
the call it checks."""
import torch

from distframe.errors import CollectiveTimeoutError
from distframe.launch import spawn


def test_a_rank_that_never_arrives_is_reported_at_the_call_it_skipped():
    # The others timed out in the signature check's all_gather and named that, not the
    # broadcast they had called.
    def fn(b):
        if b.rank == 1:
            return None
        try:
            b.broadcast(torch.ones(2), 0)
        except CollectiveTimeoutError as exc:
            return str(exc)
        return "no error"
    message = spawn(fn, 2, timeout=5, debug=True)[0]
    assert message.startswith("broadcast (sequence number 1)") and "ranks [1]" in message, message
