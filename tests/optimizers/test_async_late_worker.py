"""AsyncSGDOptimizer and a worker that the server declares dead at the worker_timeout while it is
still computing (in-memory engine): it gets a WorkerDroppedError that names the timeout, its
late gradient is never applied, and nothing waits for anything that will not come.

The model of test_async_exactly_once.py: a step's gradient is its batch, and after SGD with lr
1 the server holds minus the sum of the gradients it applied, so a late gradient applied (or
one lost) shows."""
import threading
import time

import pytest
import torch

from distframe import spawn
from distframe.models import DDPModel
from distframe.optimizers.async_protocol import BODY_TAG, HEADER_TAG, TEXT_BYTES, TEXT_TAG, Kind, send_header
from distframe.optimizers.async_sgd import AsyncSGDOptimizer
from tests.optimizers.test_async_exactly_once import _gradient, _Linear

# worker_timeout: the slow worker sleeps 3x it; every other gap between a worker's messages is a
# few ms, with room for a loaded machine (Gloo's processes: more room, as they compete for cores)
STEPS, SLOW_RANK, TIMEOUT, GLOO_TIMEOUT = 5, 2, 0.5, 2.0
MORE_STEPS = 30  # at most, for rank 1 keeping the server serving (2 ** (10 + k) stays exact)


def _rank(b, *, late_in, slow_done=None, timeout=TIMEOUT, **settings):
    """Server: (w, report). Worker: (sum of the gradients of steps that returned a loss, the
    error it got, whether it was stopped). ``late_in``: "step" (rank 2 computes its step 1 for
    three worker_timeouts) or "finish" (it rests that long after its last step, then finishes).
    With ``slow_done``, rank 1 trains on until rank 2 is through, so the server still serves."""
    model = DDPModel(_Linear(), b)
    opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=1.0, worker_timeout=timeout, max_staleness=2,
                            **settings)
    if opt.is_server:
        report = opt.serve()
        return model.gather_full_parameters()["w"], report
    pushed = torch.zeros(3, dtype=torch.float64)
    try:
        for k in range(STEPS + MORE_STEPS):
            if k >= STEPS and (b.rank == SLOW_RANK or slow_done is None or slow_done.is_set()):
                break
            if k >= STEPS:
                time.sleep(timeout / 4)

            def loss_fn(out, _, k=k):
                if late_in == "step" and b.rank == SLOW_RANK and k == 1:
                    time.sleep(3 * timeout)
                return out
            loss = opt.train_step((_gradient(b.rank, k), None), loss_fn)
            if loss == loss:
                pushed += _gradient(b.rank, k)
        if late_in == "finish" and b.rank == SLOW_RANK:
            time.sleep(3 * timeout)
        opt.finish()
    except Exception as exc:  # noqa: BLE001 - the test looks at what the worker got
        opt.finish()  # a no-op now: must neither raise nor wait
        return pushed, exc, opt.stopped
    finally:
        if slow_done is not None and b.rank == SLOW_RANK:
            slow_done.set()
    return pushed, None, opt.stopped


def _check_the_slow_worker(out, fate, steps_applied, timeout=TIMEOUT):
    w, report = out[0]
    pushed, error, _ = out[SLOW_RANK]
    assert type(error).__name__ == "WorkerDroppedError", error
    message = str(error)
    assert f"{timeout:g} s" in message and "worker_timeout" in message and "raise" in message
    assert fate in message
    assert list(report.failed_workers) == [SLOW_RANK]
    assert report.updates_per_worker[SLOW_RANK] == steps_applied
    assert torch.equal(pushed, sum(_gradient(SLOW_RANK, k) for k in range(steps_applied)))
    assert torch.equal(w, -(out[1][0] + pushed))  # applied: exactly what the workers' losses say
    return report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_worker_dropped_while_computing_gets_a_clear_error_and_its_gradient_is_not_applied(
        policy, deterministic):
    """Before, the late worker pushed a gradient that nobody received and then waited for
    parameters until the server's function returned, and got an error about the server having
    left the group (or, over an engine that cannot tell, the backend's timeout)."""
    out = spawn(lambda b: _rank(b, late_in="step", on_worker_failure=policy, deterministic=deterministic),
                3, timeout=20)
    report = _check_the_slow_worker(out, "this step's gradient was not sent", 1)
    assert report.stopped == (policy == "stop") and report.discarded_gradients == {}
    other_error, other_stopped = out[1][1], out[1][2]
    assert other_error is None and other_stopped == (policy == "stop")
    if policy == "continue":
        assert report.updates_per_worker[1] == STEPS


@pytest.mark.timeout(60)
def test_a_worker_dropped_while_resting_after_its_last_step_is_told_so_by_finish():
    """Every gradient it pushed was applied; its finish() comes after the drop, while the server
    still serves rank 1: the server takes the late DONE, and finish() raises the drop. Before,
    finish() returned as if all was well (the report said the worker had failed)."""
    slow_done = threading.Event()
    out = spawn(lambda b: _rank(b, late_in="finish", slow_done=slow_done), 3, timeout=20)
    report = _check_the_slow_worker(out, "every gradient it pushed before was applied", STEPS)
    assert not report.stopped and out[1][1] is None


@pytest.mark.timeout(60)
def test_a_late_push_that_reaches_the_server_is_received_discarded_and_reported():
    """A worker that pushes without looking for the notice (over Gloo, a receive says it has
    completed only once waited for), written here with the protocol itself: it pulls, rests
    past the timeout, pushes, and is answered DROPPED; rank 2 keeps the server serving."""
    slow_done = threading.Event()

    def fn(b):
        model = DDPModel(_Linear(), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=1.0, worker_timeout=TIMEOUT)
        if opt.is_server:
            return opt.serve(), model.gather_full_parameters()["w"]
        if b.rank == 2:
            pushed = torch.zeros(3, dtype=torch.float64)
            for k in range(50):  # exponents 20 to 69 of 2: their sum stays exact
                opt.train_step((_gradient(b.rank, k), None), lambda out, _: out)
                pushed += _gradient(b.rank, k)
                if slow_done.is_set() and k > 2:
                    break
                time.sleep(TIMEOUT / 4)
            opt.finish()
            return pushed
        header = b.recv(torch.zeros(4, dtype=torch.int64), 0, HEADER_TAG)
        b.recv(torch.zeros(3, dtype=torch.float64), 0, BODY_TAG)
        time.sleep(3 * TIMEOUT)
        send_header(b, 0, Kind.PUSH, 0, int(header[1]), 0)
        b.send(torch.full((3,), 1e6, dtype=torch.float64), 0, BODY_TAG)
        answer = b.recv(torch.zeros(4, dtype=torch.int64), 0, HEADER_TAG)
        why = bytes(b.recv(torch.zeros(TEXT_BYTES, dtype=torch.uint8), 0, TEXT_TAG).tolist())
        slow_done.set()
        return int(answer[0]), why.rstrip(b"\0").decode()
    (report, w), (answer, why), pushed = spawn(fn, 3, timeout=20)
    assert answer == Kind.DROPPED and f"worker_timeout (now {TIMEOUT:g} s)" in why
    assert torch.equal(w, -pushed)
    assert report.discarded_gradients == {1: 1} and report.updates_per_worker[1] == 0
    assert report.failed_workers[1] == (f"sent nothing for {TIMEOUT:g} s; the gradient it pushed "
                                        "afterwards was discarded")


def _gloo_rank(b):
    return _rank(b, late_in="step", on_worker_failure="continue", timeout=GLOO_TIMEOUT)


@pytest.mark.gloo
@pytest.mark.timeout(120)
def test_gloo_a_worker_dropped_while_computing_gets_the_error_and_its_gradient_is_not_applied():
    """Over Gloo a receive says it has completed only once waited for, so the late worker may
    push before it sees the notice: either way, it gets the error, and the gradient is not applied."""
    out = spawn(_gloo_rank, 3, "gloo", timeout=30)
    report = _check_the_slow_worker(out, "not", 1, timeout=GLOO_TIMEOUT)
    message = str(out[SLOW_RANK][1])
    assert "gradient was not sent" in message or "pushed after that was discarded" in message
    assert sum(report.discarded_gradients.values()) <= 1 and out[1][1] is None
