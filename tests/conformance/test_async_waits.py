"""Asynchronous work on every engine (checks in checks_async.py)."""
import pytest

from distframe.errors import CollectiveTimeoutError
from tests.conformance import checks_async


def test_wait_timeout_names_the_missing_ranks(runner):
    # Before, an expired Work.wait(timeout=...) said "unknown ranks" on every engine.
    runner.run(checks_async.check_wait_timeout_names_the_missing_ranks)


def test_waits_out_of_order_and_twice(runner):
    runner.run(checks_async.check_waits_out_of_order_and_twice)


def test_receive_wait_timeout_leaves_the_receive_posted(runner):
    runner.run(checks_async.check_receive_wait_timeout_leaves_the_receive_posted)


def test_an_asynchronous_call_never_waited_for_fails_the_run(runner):
    # Before, the failure of a call that was never waited for was dropped at shutdown: the run
    # ended as a success although rank 0 made a call the other ranks never made.
    n = runner.world_size
    if n == 1:  # nothing is missing: the call completes
        assert runner.run(checks_async.make_a_call_the_others_do_not, wait=False) == ["returned"]
        return
    with pytest.raises(CollectiveTimeoutError) as info:
        runner.run(checks_async.make_a_call_the_others_do_not, wait=False)
    # The ranks seen to have left without the call by then (all of them, or the first to leave).
    assert info.value.op == "all_reduce" and info.value.missing_ranks
    assert set(info.value.missing_ranks) <= set(range(1, n))
    assert "raised on rank 0" in "".join(info.value.__notes__)
    # A failure the rank has seen (and handled) is not raised again when the run ends.
    seen = runner.run(checks_async.make_a_call_the_others_do_not, wait=True)
    assert seen == ["seen"] + ["returned"] * (n - 1)


def test_polled_receive_completes(runner):
    runner.run(checks_async.check_polled_receive_completes)


@pytest.mark.parametrize("receive", [False, True])
def test_a_wait_timeout_that_is_not_seconds_says_so(runner, receive):
    runner.run(checks_async.check_a_wait_timeout_that_is_not_seconds_says_so, receive=receive)
