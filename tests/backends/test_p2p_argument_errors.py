"""Errors of send and recv name the method the user called (they named isend and irecv, which
send and recv run on)."""
import pytest
import torch

from distframe.backends import InMemoryCommunicationBackend


@pytest.mark.parametrize("op", ["send", "recv", "isend", "irecv"])
def test_an_out_of_range_peer_is_named_with_the_call(op):
    b = InMemoryCommunicationBackend(0, 1)
    with pytest.raises(ValueError) as caught:
        getattr(b, op)(torch.zeros(2), 3)
    assert str(caught.value).startswith(op), str(caught.value)


@pytest.mark.parametrize("op", ["send", "recv"])
def test_a_call_after_shutdown_is_named_with_the_call(op):
    b = InMemoryCommunicationBackend(0, 1)
    b.shutdown()
    with pytest.raises(ValueError, match=rf"^{op} called on .* after shutdown\(\)"):
        getattr(b, op)(torch.zeros(2), 0)
