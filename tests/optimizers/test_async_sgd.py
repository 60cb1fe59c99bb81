"""AsyncSGDOptimizer (in-memory engine): deterministic mode against explicit sequential replays,
the staleness bound, convergence on the tiny LM, and workers that fail (those that go silent or
return without finish(): test_async_departures.py)."""
import copy
import pathlib
import time

import pytest
import torch
from torch import nn

from distframe import spawn
from distframe.errors import ConfigError
from distframe.models import DDPModel
from distframe.optimizers.async_sgd import AsyncConfig, AsyncSGDOptimizer

torch.manual_seed(7)
MLP = nn.Sequential(nn.Linear(5, 10), nn.Tanh(), nn.Linear(10, 2)).double()
LR = 0.05


def _batch(worker, k):
    g = torch.Generator().manual_seed(1000 * worker + k)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return x, torch.stack([x.sum(1), x[:, 0] * x[:, 1]], dim=1)


def _run(world, steps, *, server_rank=0, worker_fn=None, timeout=60, **settings):
    """Server's (report, final parameters); workers' (losses, stopped)."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, server_rank=server_rank, **settings)
        if opt.is_server:
            return opt.serve(), model.gather_full_parameters()
        if worker_fn is not None:
            return worker_fn(b, opt)
        losses = [opt.train_step(_batch(b.rank, k), nn.functional.mse_loss) for k in range(steps)]
        opt.finish()
        return losses, opt.stopped
    return spawn(fn, world, timeout=timeout)


def _gradient(params, batch):
    model = copy.deepcopy(MLP)
    model.load_state_dict(params)
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    return [p.grad for p in model.parameters()]


def _sgd_update(params, grads, lr):
    return {k: v - lr * g for (k, v), g in zip(params.items(), grads)}


def _apply_like_the_server(params, grads, lr):
    """One torch.optim.SGD step (what the server runs), so results can be compared bitwise."""
    model = copy.deepcopy(MLP)
    model.load_state_dict(params)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("staleness_lr", [False, True])
def test_deterministic_round_robin_equals_sequential_replay(staleness_lr):
    """max_staleness >= workers - 1: workers take turns, each computing on the parameters the
    server sent right after applying its previous gradient (all start from version 0)."""
    world, steps = 4, 5
    workers = [1, 2, 3]
    (report, params), *_ = _run(world, steps, max_staleness=4, deterministic=True,
                                staleness_lr=staleness_lr)
    current = {k: v.clone() for k, v in MLP.state_dict().items()}
    pulled = {w: (current, 0) for w in workers}
    version, stalenesses = 0, []
    for k in range(steps):
        for w in workers:
            at, at_version = pulled[w]
            staleness = version - at_version
            stalenesses.append(staleness)
            lr = LR / (1 + staleness) if staleness_lr else LR
            current = _apply_like_the_server(current, _gradient(at, _batch(w, k)), lr)
            version += 1
            pulled[w] = (current, version)
    assert _equal(params, current)
    assert report.updates == steps * len(workers) and report.failed_workers == {}
    assert report.max_staleness_seen == max(stalenesses) == len(workers) - 1
    assert report.staleness_sum == sum(stalenesses)


def test_max_staleness_zero_is_sequential_sgd():
    """With no staleness allowed only one worker computes at a time: plain SGD over the
    interleaved batches (worker 1 step 0, worker 2 step 0, ..., worker 1 step 1, ...)."""
    steps = 4
    (report, params), *_ = _run(4, steps, max_staleness=0, deterministic=True)
    current = {k: v.clone() for k, v in MLP.state_dict().items()}
    for k in range(steps):
        for w in (1, 2, 3):
            current = _apply_like_the_server(current, _gradient(current, _batch(w, k)), LR)
    assert _equal(params, current)
    assert report.max_staleness_seen == 0 and report.updates == 12


@pytest.mark.timeout(60)
def test_a_manual_loop_that_pulls_before_each_forward_equals_train_step():
    """pull(); forward; backward; step() per batch (the loop the step() error suggests): step()
    already pulled the next parameters, so the next pull() must not wait for a message the
    server never sends (it waited for the backend's timeout, then blamed the server)."""
    def manual(b, opt):
        for k in range(3):
            opt.pull()
            x, y = _batch(b.rank, k)
            nn.functional.mse_loss(opt.model(x), y).backward()
            opt.step()
        opt.finish()
        return None
    (report, params), *_ = _run(3, 3, worker_fn=manual, max_staleness=1, deterministic=True, timeout=5)
    (expected_report, expected), *_ = _run(3, 3, max_staleness=1, deterministic=True)
    assert report.updates == expected_report.updates == 6 and _equal(params, expected)


def test_staleness_lr_leaves_the_configured_learning_rate_on_the_server_optimizer():
    """staleness_lr scales the rate of each stale gradient only; after serve() the optimizer
    (and so its state_dict, a checkpoint, a scheduler) holds the rate it was built with, not
    LR / (1 + t) of the last gradient applied."""
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, max_staleness=4, deterministic=True,
                                staleness_lr=True)
        if not opt.is_server:
            for k in range(3):
                opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
            opt.finish()
            return None
        report = opt.serve()
        return report.max_staleness_seen, opt.param_groups[0]["lr"], opt.state_dict()["param_groups"][0]["lr"]
    stalest, lr, saved_lr = spawn(fn, 4, timeout=60)[0]
    assert stalest > 0  # some gradient was applied at a reduced rate
    assert lr == saved_lr == LR


def test_deterministic_mode_is_reproducible_with_a_chosen_server_rank():
    first = _run(3, 4, server_rank=2, max_staleness=1, deterministic=True)
    second = _run(3, 4, server_rank=2, max_staleness=1, deterministic=True)
    report, params = first[2]
    assert _equal(params, second[2][1])
    assert report.updates_per_worker == {0: 4, 1: 4} and report.max_staleness_seen <= 1


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_free_running_respects_the_staleness_bound_with_a_slow_worker(max_staleness):
    steps = 6

    def worker(b, opt):
        losses = []
        for k in range(steps):
            if b.rank == 1:
                time.sleep(0.02)  # the slow worker: others run ahead until the gate holds them
            losses.append(opt.train_step(_batch(b.rank, k), nn.functional.mse_loss))
        opt.finish()
        return losses, opt.stopped
    out = _run(4, steps, worker_fn=worker, max_staleness=max_staleness)
    report = out[0][0]
    assert report.updates == 18 and set(report.updates_per_worker.values()) == {steps}
    assert report.max_staleness_seen <= max_staleness
    if max_staleness == 3:
        assert report.max_staleness_seen >= 1  # it is asynchronous


def _tiny_lm():
    from attention.model import DilatedTransformerConfig, DilatedTransformerLM
    torch.manual_seed(0)
    return DilatedTransformerLM(DilatedTransformerConfig.preset("tiny", seq_len=32, segment_lengths=(8, 16, 32)))


TEXT = torch.tensor(list((pathlib.Path(__file__).parents[2] / "attention" / "model.py").read_bytes()))


def _lm_batch(seed, size=4):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(TEXT) - 33, (size,), generator=g)
    tokens = torch.stack([TEXT[i:i + 33] for i in starts])
    return tokens[:, :-1], tokens[:, 1:]


def _lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_free_running_converges_on_the_tiny_lm():
    lm, steps = _tiny_lm(), 25
    held_out = _lm_batch(99_999, size=16)
    with torch.no_grad():
        initial = float(_lm_loss(lm(held_out[0]), held_out[1]))

    def fn(b):
        model = DDPModel(copy.deepcopy(lm), b)
        opt = AsyncSGDOptimizer(model, torch.optim.AdamW, lr=1e-2, max_staleness=2, staleness_lr=True)
        if opt.is_server:
            report = opt.serve()
            with torch.no_grad():
                return report, float(_lm_loss(model(held_out[0]), held_out[1]))
        for k in range(steps):
            opt.train_step(_lm_batch(100 * b.rank + k), _lm_loss)
        opt.finish()
        return None
    report, final = spawn(fn, 4, timeout=120)[0]
    print(f"tiny LM held-out loss {initial:.3f} -> {final:.3f}; mean staleness {report.mean_staleness:.2f}")
    assert report.updates == 3 * steps and report.max_staleness_seen <= 2
    assert final < initial - 1.0


class _Boom(RuntimeError):
    pass


def _failing_worker(steps, fail_rank, fail_at):
    def worker(b, opt):
        losses = []
        try:
            for k in range(steps):
                def loss_fn(out, target, k=k):
                    if b.rank == fail_rank and k == fail_at:
                        raise _Boom(f"worker {b.rank} broke at step {k}")
                    return nn.functional.mse_loss(out, target)
                losses.append(opt.train_step(_batch(b.rank, k), loss_fn))
                if opt.stopped:
                    break
        except _Boom:
            return "failed", opt.stopped  # a supervisor caught it; this rank ends normally
        opt.finish()
        return losses, opt.stopped
    return worker


@pytest.mark.timeout(60)
def test_failed_worker_is_reported_and_the_others_continue():
    steps = 8
    out = _run(4, steps, worker_fn=_failing_worker(steps, 2, 3), max_staleness=2)
    report = out[0][0]
    assert list(report.failed_workers) == [2] and "broke at step 3" in report.failed_workers[2]
    assert not report.stopped
    assert report.updates_per_worker == {1: steps, 2: 3, 3: steps}
    assert out[2] == ("failed", False)
    assert len(out[1][0]) == steps and not out[1][1]


@pytest.mark.timeout(60)
def test_failed_worker_stops_the_others_cleanly_when_configured():
    steps = 50
    out = _run(4, steps, worker_fn=_failing_worker(steps, 2, 3), max_staleness=2,
               on_worker_failure="stop")
    report = out[0][0]
    assert report.stopped and list(report.failed_workers) == [2]
    for rank in (1, 3):
        losses, stopped = out[rank]
        assert stopped and len(losses) < steps
    assert report.updates < 2 * steps


@pytest.mark.timeout(60)
def test_train_step_after_a_stop_returns_nan_without_waiting_for_the_server():
    """A stopped worker that keeps calling train_step (as documented: nan) must not wait for
    parameters from a server that has finished."""
    steps = 12

    def worker(b, opt):
        if b.rank == 2:
            opt.train_step(_batch(b.rank, 0), nn.functional.mse_loss)
            opt.report_failure(RuntimeError("worker 2 gave up"))
            return None
        losses = [opt.train_step(_batch(b.rank, k), nn.functional.mse_loss) for k in range(steps)]
        opt.finish()
        return losses, opt.stopped
    out = _run(4, steps, worker_fn=worker, max_staleness=2, on_worker_failure="stop")
    assert out[0][0].stopped
    for losses, stopped in (out[1], out[3]):
        assert stopped and len(losses) == steps and all(x != x for x in losses[-2:])


@pytest.mark.timeout(60)
def test_training_after_finish_or_a_reported_failure_is_a_config_error():
    """The server has let go of such a worker: a gradient it pushed would never be applied, and
    the worker would wait for parameters that never come."""
    def worker(b, opt):
        opt.train_step(_batch(b.rank, 0), nn.functional.mse_loss)
        if b.rank == 1:
            opt.finish()
        else:
            opt.report_failure(RuntimeError("worker 2 gave up"))
        with pytest.raises(ConfigError, match="finish|failure"):
            opt.train_step(_batch(b.rank, 1), nn.functional.mse_loss)
        with pytest.raises(ConfigError, match="finish|failure"):
            opt.step()
        return None, opt.stopped
    report = _run(3, 2, worker_fn=worker, max_staleness=1)[0][0]
    assert report.updates_per_worker == {1: 1, 2: 1} and list(report.failed_workers) == [2]


@pytest.mark.timeout(60)
def test_an_uncaught_worker_error_ends_the_run_without_hanging():
    with pytest.raises(_Boom, match="broke at step 1"):
        def worker(b, opt):
            def loss_fn(out, target):
                raise _Boom(f"worker {b.rank} broke at step 1")
            opt.train_step(_batch(b.rank, 0), nn.functional.mse_loss)
            opt.train_step(_batch(b.rank, 1), loss_fn if b.rank == 1 else nn.functional.mse_loss)
            opt.finish()
        _run(3, 2, worker_fn=worker)


@pytest.mark.parametrize("settings, field", [
    ({"max_staleness": -1}, "max_staleness"), ({"on_worker_failure": "retry"}, "on_worker_failure"),
    ({"worker_timeout": 0}, "worker_timeout"), ({"deterministic": 1}, "deterministic"),
    ({"worker_timeout": True}, "worker_timeout"), ({"worker_timeout": float("inf")}, "worker_timeout"),
    ({"max_staleness": 2.0}, "max_staleness"),
])
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        AsyncConfig(**settings)


def test_misuse_is_a_config_error():
    def fn(b):
        model = DDPModel(copy.deepcopy(MLP), b)
        with pytest.raises(ConfigError, match="server_rank"):
            AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1, server_rank=5)
        opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1)
        with pytest.raises(ConfigError, match="serve" if opt.is_server else "train_step"):
            if opt.is_server:
                opt.train_step(_batch(0, 0), nn.functional.mse_loss)
            else:
                opt.serve()
        with pytest.raises(ConfigError, match="config= or as keywords"):
            AsyncSGDOptimizer(model, torch.optim.SGD, lr=0.1, config=AsyncConfig(), max_staleness=2)
    spawn(fn, 2, timeout=30)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        spawn(lambda b: AsyncSGDOptimizer(DDPModel(copy.deepcopy(MLP), b), torch.optim.SGD, lr=0.1), 1)


def _gloo_rank(b, max_staleness, deterministic):
    model = DDPModel(copy.deepcopy(MLP), b)
    opt = AsyncSGDOptimizer(model, torch.optim.SGD, lr=LR, max_staleness=max_staleness,
                            deterministic=deterministic, worker_timeout=30)
    if opt.is_server:
        return opt.serve(), model.gather_full_parameters()
    for k in range(4):
        opt.train_step(_batch(b.rank, k), nn.functional.mse_loss)
    opt.finish()
    return None


@pytest.mark.gloo
@pytest.mark.timeout(120)
def test_gloo_processes_match_the_in_memory_run_and_free_running_works():
    import functools
    det = spawn(functools.partial(_gloo_rank, max_staleness=2, deterministic=True), 3, "gloo", timeout=30)
    threads = spawn(functools.partial(_gloo_rank, max_staleness=2, deterministic=True), 3, timeout=30)
    assert _equal(det[0][1], threads[0][1]) and det[0][0].updates == 8
    free = spawn(functools.partial(_gloo_rank, max_staleness=1, deterministic=False), 3, "gloo", timeout=30)
    assert free[0][0].updates == 8 and free[0][0].max_staleness_seen <= 1
