"""A weight tied across pipeline stages that the forward changes in place.

Each stage holding a tied weight (a GPT-style embedding on stage 0, its head on the last) keeps
its own copy, and the copies stay equal because their gradients are summed and stepped alike.
``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in its forward, in place: only
stage 0's copy changed, the head computed with the stale one, and the pipeline trained another
model with no error (losses [4.387, 4.536] where one process has [2.767, 3.223]). It is refused
now, as a buffer shared across stages and changed in place is; a weight tied within one stage, or
an untied one renormalised in place, trains as one process does. float64, 1e-10.
"""
from __future__ import annotations

import functools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError, RankFailedError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, PipelineParallelModel
from tests.models.common import SEED_LOCK

TOL = dict(rtol=1e-10, atol=1e-10)
VOCAB, WIDTH = 12, 8


def cross_entropy(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def token_batches(count=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g))
            for _ in range(count)]


def embedding_and_head(tie=True, max_norm=1.0):
    """Embedding (rows of norm about 8, so max_norm renormalises them), Linear, Tanh, head."""
    with SEED_LOCK:
        torch.manual_seed(0)
        emb = nn.Embedding(VOCAB, WIDTH, max_norm=max_norm, dtype=torch.float64)
        middle = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.mul_(3)
    if tie:
        head.weight = emb.weight
    return nn.Sequential(emb, middle, nn.Tanh(), head)


def head_on_stage_zero():
    """The tied head beside its embedding, on one stage, and a layer after them."""
    with SEED_LOCK:
        torch.manual_seed(0)
        emb = nn.Embedding(VOCAB, WIDTH, max_norm=1.0, dtype=torch.float64)
        head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=torch.float64)
        last = nn.Linear(VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.mul_(3)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Tanh(), head, last)


def one_process(model):
    return sgd_losses(model, token_batches(), cross_entropy, lr=0.5)


def sgd_losses(model, batches, loss_fn, lr):
    """One process's SGD steps of ``model`` on ``batches``; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _pipeline_steps(backend, build, split_points, num_microbatches=1):
    pipe = PipelineParallelModel(build(), backend, num_microbatches=num_microbatches,
                                 split_points=split_points)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = [pipe.train_step(batch, cross_entropy, opt) for batch in token_batches()]
    return losses, pipe.gather_full_parameters()


def _recording(fn, raised):
    """``fn`` on a rank, what it raised kept in ``raised[rank]``."""
    lock = threading.Lock()

    def run(backend):
        try:
            return fn(backend)
        except Exception as exc:
            with lock:
                raised[backend.rank] = exc
            raise
    return run


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_weight_tied_across_stages_and_renormalised_in_forward_is_refused(num_microbatches):
    raised = {}
    steps = functools.partial(_pipeline_steps, build=embedding_and_head, split_points=[2],
                              num_microbatches=num_microbatches)
    with pytest.raises(ConfigError, match=r"parameter '0.weight' is tied to '3.weight'.*"
                                          r"changed this rank.s copy in place.*max_norm.*Untie the weights"):
        spawn(_recording(steps, raised), 2, timeout=20)
    # Stage 0's copy changed; the last stage, waiting for it, stops at once rather than hang.
    assert isinstance(raised[0], ConfigError)
    assert isinstance(raised[1], RankFailedError)


def test_evaluating_such_a_weight_is_refused_too():
    # Renormalisation happens without grad too: an evaluation parts the copies just the same.
    def evaluate(backend):
        pipe = PipelineParallelModel(embedding_and_head(), backend, num_microbatches=1, split_points=[2])
        pipe.eval()
        with torch.no_grad():
            pipe(token_batches(1)[0][0])

    with pytest.raises(ConfigError, match=r"parameter '0.weight' is tied to '3.weight'"):
        spawn(evaluate, 2, timeout=20)


def test_a_hybrid_model_with_such_a_weight_is_refused():
    # pp x tp, the tied weight replicated over the tensor ranks (over data-parallel replicas
    # max_norm is refused at construction: each replica would renormalise other rows).
    def steps(backend):
        model = HybridShardedModel(embedding_and_head(), backend, dims=ParallelDims(tp=2, pp=2),
                                   tp_plan={"1": "column"}, split_points=[2])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model.train_step(token_batches(1)[0], cross_entropy, opt)

    with pytest.raises(ConfigError, match=r"parameter '0.weight' is tied to '3.weight'.*"
                                          r"changed this rank.s copy in place"):
        spawn(steps, 4, timeout=20)


@pytest.mark.parametrize("build,split_points", [
    (functools.partial(embedding_and_head, tie=False), [2]),   # renormalised, held by one stage
    (functools.partial(embedding_and_head, max_norm=None), [2]),  # tied, nothing changes it in place
    (head_on_stage_zero, [3]),                                   # tied and renormalised on one stage
], ids=["untied-max-norm", "tied-no-max-norm", "tied-within-a-stage"])
def test_what_stays_one_model_trains_as_one_process(build, split_points):
    reference = build()
    want = one_process(reference)
    for losses, full in spawn(functools.partial(_pipeline_steps, build=build, split_points=split_points), 2,
                              timeout=20):
        assert losses == pytest.approx(want, rel=1e-12)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)
