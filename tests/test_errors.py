"""Errors carry their fields and survive pickling (process launchers send them to the caller)."""
import pickle

import pytest

from distframe.errors import (BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError,
                              ConfigError, DistFrameError, RankFailedError)


@pytest.mark.parametrize("error", [
    CollectiveTimeoutError("all_gather", 7, [1, 3], 2.5, "global ranks [5, 7]"),
    CollectiveTimeoutError("barrier", 2, None, 1.0),
    CollectiveTimeoutError("barrier", 2, [1], 0.0, "rank 1 left", early=True),
    CollectiveMismatchError("all_reduce", 4, "rank 1 called broadcast(shape=(2,))"),
    RankFailedError(2, "KeyError: 'x'"),
    RankFailedError(None),
    ConfigError("world_size must be positive"),
    BackendUnavailableError("pip install mpi4py mpich"),
])
def test_round_trip_through_pickle(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert isinstance(copy, DistFrameError)
    for field in ("op", "seq", "missing_ranks", "timeout", "failed_rank"):
        assert getattr(copy, field, None) == getattr(error, field, None)


def test_timeout_message_names_everything():
    e = CollectiveTimeoutError("all_gather", 7, [3, 1], 2.5)
    assert str(e) == "all_gather (sequence number 7) timed out after 2.5 s: ranks [1, 3] did not arrive"


def test_a_rank_that_stopped_before_its_timeout_does_not_say_it_timed_out():
    e = CollectiveTimeoutError("barrier", 3, [1], 0.0, "rank 1 left the group", early=True)
    assert str(e) == ("barrier (sequence number 3) stopped after 0 s, before its timeout: ranks [1] did "
                      "not arrive; rank 1 left the group")


def test_mismatch_and_config_errors_are_value_errors():
    assert issubclass(CollectiveMismatchError, ValueError) and issubclass(ConfigError, ValueError)
