"""DDP, ZeRO-1 and ZeRO-2 where the end-of-backward wait would stop the peers it waits for
(in-memory ranks sharing a GPU's autograd thread): the gradient average completes at the rank's
next optimizer step, ``synchronize_gradients()`` or forward instead, and training is unchanged.

On a GPU the condition is real (tests/models/test_gpu.py); here each rank's backend reports its
peer as sharing the thread, which takes the same path on the CPU. float64, 1e-10."""
import threading

import pytest
import torch

from distframe.launch import spawn
from distframe.models import DDPModel
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, reference_run)

TOL = dict(rtol=0, atol=1e-10)
pytestmark = pytest.mark.filterwarnings("ignore:in-memory ranks .* share this rank's GPU")


def sharing(backend):
    """``backend`` as if every peer ran its backward on this rank's autograd thread."""
    peers = [r for r in range(backend.world_size) if r != backend.rank]
    backend.peers_sharing_autograd_thread = lambda: peers
    return backend


def plain_step(model, opt, x, y):
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_a_plain_optimizer_steps_on_the_average():
    # The torch DDP loop: nothing of ours runs between backward and step, so the step's
    # pre-hook must complete the deferred average.
    def run(backend):
        model = DDPModel(build_model(), sharing(backend), **SETTINGS["ddp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for batch in global_batches(4, 12):
            plain_step(model, opt, *rank_slice(batch, backend.rank, backend.world_size))
        return model.gather_full_parameters()
    expected = reference_run(global_batches(4, 12))[-1]
    # The rank threads share the process's warning state: caught here, around them all.
    with pytest.warns(RuntimeWarning, match=r"model\.synchronize_gradients\(\) before reading \.grad"):
        results = spawn(run, 3)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=name)


def test_without_deferral_backward_leaves_the_average():
    # The control: the same loop, no peer on the thread, averaged when backward returns.
    def run(backend):
        model = DDPModel(build_model(), backend, **SETTINGS["ddp"])
        x, y = rank_slice(global_batches(1, 12)[0], backend.rank, backend.world_size)
        loss_fn(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]
    grads = spawn(run, 2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_deferred_gradients_are_local_until_synchronised():
    # What the warning says: .grad read straight after backward is not yet the average. Rank 1
    # starts its backward only once rank 0 has read .grad, so rank 0's average cannot have
    # completed by then (without the hold, whether it had was a race between the two threads).
    batch = global_batches(1, 12)[0]
    rank0_read = threading.Event()

    def run(backend):
        model = DDPModel(build_model(), sharing(backend), **SETTINGS["ddp"])
        x, y = rank_slice(batch, backend.rank, backend.world_size)
        if backend.rank == 1:
            assert rank0_read.wait(30)
        loss_fn(model(x), y).backward()
        before = [p.grad.clone() for p in model.parameters()]
        rank0_read.set()
        model.synchronize_gradients()
        return before, [p.grad.clone() for p in model.parameters()]
    (before0, after0), (_, after1) = spawn(run, 2)
    local = build_model()
    loss_fn(local(rank_slice(batch, 0, 2)[0]), rank_slice(batch, 0, 2)[1]).backward()
    whole = build_model()
    loss_fn(whole(batch[0]), batch[1]).backward()
    for a, p in zip(before0, local.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=0)
    for a, b, p in zip(after0, after1, whole.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, p.grad, **TOL)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_train_step_and_a_second_forward_before_the_step(strategy):
    # train_step synchronises after backward; a forward/backward whose step comes only after
    # the next forward (accumulation without no_sync) is finished by that forward.
    model_cls, opt_cls = STRATEGIES[strategy]
    batches = global_batches(3, 12)

    def run(backend):
        model = model_cls(build_model(), sharing(backend), **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in batches[:2]:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        x, y = rank_slice(batches[2], backend.rank, backend.world_size)
        half = x.shape[0] // 2
        loss_fn(model(x[:half]), y[:half]).backward()
        loss_fn(model(x[half:]), y[half:]).backward()
        opt.step()
        return model.gather_full_parameters()
    # The last step's gradient is the average of the two half-batch means over the ranks.
    reference = build_model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for batch in batches[:2]:
        loss_fn(reference(batch[0]), batch[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    x, y = batches[2]
    world = 2
    for r in range(world):
        xr, yr = rank_slice((x, y), r, world)
        half = xr.shape[0] // 2
        for part in (slice(None, half), slice(half, None)):
            (loss_fn(reference(xr[part]), yr[part]) / world).backward()
    ref_opt.step()
    for params in spawn(run, world):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, **TOL, msg=f"{strategy} {name}")
