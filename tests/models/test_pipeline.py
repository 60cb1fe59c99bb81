"""Pipeline parallelism: schedules, splitting, and parity with the unsplit model (loss, output
and every stage's gradients; float64 1e-10, float32 1e-5) over a grid of (stages, micro-batches)
including m < p and m not divisible by p; measured activation memory and bubble."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.pipeline_schedules import (gpipe, max_in_flight, one_f_one_b,
                                                 schedule_actions)
from distframe.models.stages import partition, split_into_stages
from tests.models.common import SEED_LOCK, Block, lm_loss, tiny_lm

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def sequential(dtype=torch.float64, blocks=4, width=8):
    with SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, width), *[Block(width) for _ in range(blocks)],
                             nn.Linear(width, 3)).to(dtype)


def mse(out, target):
    return F.mse_loss(out, target)


def data(batch, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch, 5, generator=g, dtype=dtype), torch.randn(batch, 3, generator=g, dtype=dtype)


# ---- schedules and splitting ---------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 7), (3, 9)])
def test_schedules_cover_every_microbatch_once(p, m):
    for stage in range(p):
        for actions in (gpipe(p, stage, m), one_f_one_b(p, stage, m)):
            forward = [a.microbatch for a in actions if a.kind == "F"]
            backward = [a.microbatch for a in actions if a.kind == "B"]
            assert forward == list(range(m)) and backward == list(range(m))
            assert all(actions.index(type(a)("F", a.microbatch)) < i
                       for i, a in enumerate(actions) if a.kind == "B")
        assert max_in_flight(gpipe(p, stage, m)) == m
        assert max_in_flight(one_f_one_b(p, stage, m)) == min(p - stage, m)


def _runs_to_completion(name, p, m, v=1):
    """Executes every rank's action list with eager sends and blocking receives: a rank waits
    until its next action's input (forward of the previous global stage, backward of the next)
    exists. False means the schedule deadlocks."""
    lists = [schedule_actions(name, p, r, m, v) for r in range(p)]
    done, position, stages = set(), [0] * p, p * v
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while position[r] < len(lists[r]):
                a = lists[r][position[r]]
                g = a.chunk * p + r
                if a.kind == "F":
                    ready = g == 0 or ("F", g - 1, a.microbatch) in done
                else:
                    ready = ("F", g, a.microbatch) in done and (
                        g == stages - 1 or ("B", g + 1, a.microbatch) in done)
                if not ready:
                    break
                done.add((a.kind, g, a.microbatch))
                position[r] += 1
                progress = True
    return position == [len(x) for x in lists] and len(done) == 2 * m * stages


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 8, 2), (4, 4, 3)])
def test_schedules_never_deadlock(p, m, v):
    assert _runs_to_completion("gpipe", p, m) and _runs_to_completion("1f1b", p, m)
    assert _runs_to_completion("interleaved_1f1b", p, m, v)
    for r in range(p):
        actions = schedule_actions("interleaved_1f1b", p, r, m, v)
        assert sorted((a.kind, a.chunk, a.microbatch) for a in actions) == sorted(
            (k, c, i) for k in "FB" for c in range(v) for i in range(m))


def test_interleaving_needs_rounds_of_p_microbatches():
    with pytest.raises(ConfigError, match="multiple of pp=2"):
        schedule_actions("interleaved_1f1b", 2, 0, 3, 2)
    with pytest.raises(ConfigError, match="virtual_stages"):
        spawn(lambda b: PipelineParallelModel(sequential(), b, num_microbatches=2, virtual_stages=2), 2)


def test_virtual_stages_need_a_pipeline():
    # With pp == 1 (one rank) there are no stages to interleave: the schedule and the chunks
    # were ignored.
    with pytest.raises(ConfigError, match="virtual_stages=2 needs pipeline parallelism"):
        spawn(lambda b: PipelineParallelModel(sequential(), b, num_microbatches=2,
                                              schedule="interleaved_1f1b", virtual_stages=2), 1)


def test_too_many_virtual_stages_for_the_layers_names_the_fix():
    # 6 layers, pp=2 x virtual_stages=4 = 8 stages: the error used to suggest pp <= 6.
    def build(b):
        PipelineParallelModel(sequential(), b, num_microbatches=4, schedule="interleaved_1f1b",
                              virtual_stages=4)

    with pytest.raises(ConfigError, match=r"virtual_stages <= 3"):
        spawn(build, 2, timeout=20)


def test_partition_balances_and_honours_split_points():
    assert partition([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert partition([30, 5, 5, 5, 5, 10], 3) == [range(0, 1), range(1, 4), range(4, 6)]
    assert partition([1, 1, 1, 1, 1], 2, split_points=[4]) == [range(0, 4), range(4, 5)]
    with pytest.raises(ConfigError, match="split_points"):
        partition([1, 1, 1], 2, split_points=[3])
    with pytest.raises(ConfigError, match="at most 3 stages"):
        partition([1, 1, 1], 4)


def test_split_lm_into_embedding_blocks_head():
    lm = tiny_lm(num_layers=4)
    stages = split_into_stages(lm, 3)
    assert sum(len(s.layers) for s in stages) == 6
    tokens = torch.randint(0, 256, (2, 16))
    x = tokens
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, lm(tokens), rtol=0, atol=0)


# ---- parity -------------------------------------------------------------------------------------
def _reference(model, x, y):
    dense = copy.deepcopy(model)
    out = dense(x)
    loss = mse(out, y)
    loss.backward()
    return float(loss.detach()), out.detach(), {n: p.grad for n, p in dense.named_parameters()}


def _pipeline_run(b, model, x, y, m, schedule, split_points=None, loss_fn=mse):
    pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=m, schedule=schedule,
                                 split_points=split_points)
    with torch.no_grad():
        out = pipe(x)
    loss = float(pipe.forward_backward((x, y), loss_fn))
    pipe.synchronize_gradients()
    grads = {lp.name: lp.param.grad.clone() for lp in pipe.local_parameters}
    return loss, out, grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (3, 4), (4, 3), (4, 6)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sequential_equals_unsplit(schedule, p, m, dtype):
    model = sequential(dtype)
    x, y = data(12, dtype)
    loss, out, grads = _reference(model, x, y)
    results = spawn(lambda b: _pipeline_run(b, model, x, y, m, schedule), p)
    tol = TOLERANCE[dtype]
    seen = set()
    for rank_loss, rank_out, rank_grads in results:
        assert rank_loss == pytest.approx(loss, rel=tol["rtol"])
        torch.testing.assert_close(rank_out, out, **tol)
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], **tol, msg=name)
        seen |= set(rank_grads)
    assert seen == set(grads)  # every parameter lives on some stage
    assert all(len(r[2]) < len(grads) for r in results)  # and no stage holds them all


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (3, 6, 2)])
def test_interleaved_1f1b_equals_unsplit(p, m, v):
    model = sequential()
    x, y = data(12)
    loss, out, grads = _reference(model, x, y)

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=m,
                                     schedule="interleaved_1f1b", virtual_stages=v)
        with torch.no_grad():
            output = pipe(x)
        rank_loss = float(pipe.forward_backward((x, y), mse))
        return rank_loss, output, {lp.name: lp.param.grad.clone() for lp in pipe.local_parameters}

    seen = set()
    for rank_loss, rank_out, rank_grads in spawn(run, p):
        assert rank_loss == pytest.approx(loss, rel=1e-12)
        torch.testing.assert_close(rank_out, out, rtol=1e-10, atol=1e-10)
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-10, atol=1e-10, msg=name)
        seen |= set(rank_grads)
    assert seen == set(grads)


@pytest.mark.parametrize("p,m,split_points", [(2, 2, None), (3, 4, None), (3, 2, [1, 3])])
def test_lm_with_tied_embedding_equals_unsplit(p, m, split_points):
    lm = tiny_lm(num_layers=3)
    x = torch.randint(0, 256, (4, 16))
    y = torch.randint(0, 256, (4, 16))
    dense = copy.deepcopy(lm)
    dense_out = dense(x)
    loss = lm_loss(dense_out, y)
    loss.backward()
    grads = {n: p_.grad for n, p_ in dense.named_parameters()}
    results = spawn(lambda b: _pipeline_run(b, lm, x, y, m, "1f1b", split_points, lm_loss), p)
    for rank_loss, rank_out, rank_grads in results:
        assert rank_loss == pytest.approx(float(loss.detach()), rel=1e-12)
        torch.testing.assert_close(rank_out, dense_out.detach(), rtol=1e-10, atol=1e-10)
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-10, atol=1e-10, msg=name)
    # The tied embedding/head weight is on the first and the last stage, with the summed gradient.
    assert "tok_embedding.weight" in results[0][2] and "tok_embedding.weight" in results[-1][2]


@pytest.mark.parametrize("p", [2, 3])
def test_tied_weight_accumulates_over_backwards_synchronised_in_turn(p):
    # Two backwards, each followed by synchronize_gradients (no zero_grad between): the gradients
    # add up as in one process. The tied embedding/head gradient, summed across its stages after
    # the first backward, was summed again with the second: the first counted once per stage.
    lm = tiny_lm(num_layers=2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
               for _ in range(2)]
    dense = copy.deepcopy(lm)
    for x, y in batches:
        lm_loss(dense(x), y).backward()

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(lm), b, num_microbatches=2)
        for x, y in batches:
            pipe.forward_backward((x, y), lm_loss)
            pipe.synchronize_gradients()
        return {lp.name: lp.param.grad.clone() for lp in pipe.local_parameters}

    grads = dict(dense.named_parameters())
    for rank_grads in spawn(run, p):
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name].grad, rtol=1e-10, atol=1e-10, msg=name)


def test_train_step_returns_global_mean_on_every_stage():
    model = sequential()
    x, y = data(8)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(3):
        loss = mse(reference(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=4)
        o = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = [pipe.train_step((x, y), mse, o) for _ in range(3)]
        return losses, pipe.gather_full_parameters()

    for losses, full in spawn(run, 3):
        assert losses == pytest.approx(expected, rel=1e-12)
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(full[name], tensor, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_steps_of_different_batch_sizes_each_equal_unsplit(schedule):
    # Receives are posted ahead within a step (the next activation, each output's gradient);
    # none may be left to catch the next step's messages, whose shapes differ here.
    model = sequential()
    batches = [data(12), data(4), data(8)]
    expected = [_reference(model, x, y)[::2] for x, y in batches]  # (loss, grads) per batch
    v = 2 if schedule == "interleaved_1f1b" else 1

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=4, schedule=schedule,
                                     virtual_stages=v)
        out = []
        for x, y in batches:
            loss = pipe.forward_backward((x, y), mse)
            pipe.synchronize_gradients()
            out.append((float(loss), {lp.name: lp.param.grad.clone() for lp in pipe.local_parameters}))
            pipe.zero_grad()
        return out

    for per_batch in spawn(run, 2):
        for (loss, grads), (ref_loss, ref_grads) in zip(per_batch, expected):
            assert loss == pytest.approx(float(ref_loss), rel=1e-12)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-10, msg=name)


def test_indivisible_batch_is_a_config_error():
    model = sequential()
    x, y = data(6)

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=4)
        pipe.forward_backward((x, y), mse)

    with pytest.raises(ConfigError, match="not divisible by num_microbatches=4"):
        spawn(run, 2, timeout=10)


# ---- measured memory and bubble -------------------------------------------------------------------
def _peak_activation_bytes(b, model, x, y, m, schedule):
    pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=m, schedule=schedule)
    pipe.activation_memory.enabled = True
    pipe.forward_backward((x, y), mse)
    return pipe.activation_memory.peak_bytes, pipe.activation_memory.live_bytes


def test_activation_memory_is_counted_only_when_enabled():
    model = sequential(blocks=2, width=16)
    x, y = data(8)

    def run(b):
        pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=4)
        pipe.forward_backward((x, y), mse)
        off = pipe.activation_memory.peak_bytes
        pipe.activation_memory.enabled = True
        pipe.forward_backward((x, y), mse)
        return off, pipe.activation_memory.peak_bytes

    for off, on in spawn(run, 2):
        assert off == 0 and on > 0


def test_1f1b_holds_at_most_p_microbatches_of_activations():
    p, m = 4, 8
    model = sequential(blocks=6, width=32)
    x, y = data(64)
    gpipe_peaks = spawn(lambda b: _peak_activation_bytes(b, model, x, y, m, "gpipe"), p)
    ofob_peaks = spawn(lambda b: _peak_activation_bytes(b, model, x, y, m, "1f1b"), p)
    for stage in range(p):
        g_peak, g_live = gpipe_peaks[stage]
        o_peak, o_live = ofob_peaks[stage]
        assert g_live == 0 and o_live == 0  # everything saved was released by the backwards
        # Each micro-batch saves the same bytes: GPipe holds m of them, 1F1B min(p - s, m).
        per_microbatch = g_peak / m
        assert o_peak == pytest.approx(per_microbatch * min(p - stage, m), rel=0.05)


class _LiveCounter(nn.Module):
    """Passes its input on; counts how many of the tensors it was shown are still alive (by
    storage) at each forward: its inputs at the end of a stage (the activations the stage sends),
    or with ``gradients`` the input gradients of the next stage (the gradients it sends back)."""

    def __init__(self, gradients=False):
        super().__init__()
        self.gradients, self.live, self.peak = gradients, set(), 0

    def _watch(self, tensor):
        key = object()
        self.live.add(key)
        weakref.finalize(tensor.untyped_storage(), self.live.discard, key)

    def forward(self, x):
        self.peak = max(self.peak, len(self.live))
        if not self.gradients:
            self._watch(x)
        elif x.requires_grad:  # the received leaf, whose .grad is sent back, may sit behind a grad_fn
            leaf = x if x.grad_fn is None else x.grad_fn.next_functions[0][0].variable
            leaf.register_post_accumulate_grad_hook(lambda t: self._watch(t.grad))
        return x


def test_1f1b_frees_what_it_sent_as_the_schedule_goes():
    # The activations a stage sent and the input gradients it sent back were kept until the end
    # of the step: every micro-batch's, not the p in flight that 1F1B promises.
    p, m = 2, 8

    def run(b):
        sent, sent_back = _LiveCounter(), _LiveCounter(gradients=True)
        model = nn.Sequential(nn.Linear(5, 8), Block(8), sent, sent_back, Block(8), nn.Linear(8, 3)).double()
        pipe = PipelineParallelModel(model, b, num_microbatches=m, schedule="1f1b", split_points=[3])
        pipe.forward_backward(data(16), mse)
        return sent.peak if b.rank == 0 else sent_back.peak

    assert all(peak <= p for peak in spawn(run, p))
