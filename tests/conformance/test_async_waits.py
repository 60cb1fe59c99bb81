"""Asynchronous work on every engine (checks in checks_async.py)."""
from tests.conformance import checks_async


def test_wait_timeout_names_the_missing_ranks(runner):
    # Before, an expired Work.wait(timeout=...) said "unknown ranks" on every engine.
    runner.run(checks_async.check_wait_timeout_names_the_missing_ranks)


def test_waits_out_of_order_and_twice(runner):
    runner.run(checks_async.check_waits_out_of_order_and_twice)


def test_receive_wait_timeout_leaves_the_receive_posted(runner):
    runner.run(checks_async.check_receive_wait_timeout_leaves_the_receive_posted)
