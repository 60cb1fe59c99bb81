"""nn.Embedding(max_norm=...) and nn.EmbeddingBag(max_norm=...) renormalise, in place during
forward, only the rows this rank looks up: under DDP the replicas drifted apart (1.58 after one SGD
step), under ZeRO-1/2 the ranks agreed but were 0.34 off one process, without a word. Wrapping such
a model over more than one data-parallel rank is now a ConfigError naming the module; one rank, and
embeddings without max_norm, are unaffected."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel
from tests.models.common import SEED_LOCK, STRATEGIES

V, B = 10, 8


class Net(nn.Module):
    def __init__(self, bag: bool = False, **options) -> None:
        super().__init__()
        self.body = nn.ModuleDict({
            "emb": (nn.EmbeddingBag(V, 6, mode="mean", **options) if bag else nn.Embedding(V, 6, **options))})
        self.bag = bag
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.body["emb"](x)
        return self.head(h if self.bag else h.mean(1))


def build(**kw) -> Net:
    with SEED_LOCK:
        torch.manual_seed(0)
        return Net(**kw).double()


X = torch.stack([torch.arange(0, 4)] * 4 + [torch.arange(4, 8)] * 4)
Y = torch.randn(B, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_max_norm_is_refused_at_wrap_time(strategy, bag):
    model_cls, _ = STRATEGIES[strategy]

    def run(b):
        net = build(bag=bag, max_norm=1.0)
        kind = "EmbeddingBag" if bag else "Embedding"
        with pytest.raises(ConfigError, match=rf"'body\.emb' \({kind}\) has max_norm=1\.0.*drop max_norm"):
            model_cls(net, b)
        net.body["emb"].max_norm = None  # fixed, the same module wraps
        return model_cls(net, b) is not None

    assert spawn(run, 2) == [True, True]


def test_hybrid_with_data_parallel_ranks_refuses_it():
    def run(b):
        with pytest.raises(ConfigError, match=r"HybridShardedModel: 'body\.emb' \(Embedding\) has max_norm"):
            HybridShardedModel(build(max_norm=1.0), b, dims=ParallelDims(dp=2))

    spawn(run, 2)


def _train(backend, strategy: str, **options):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build(**options), backend)
    opt = opt_cls(model, torch.optim.SGD, lr=0.1)
    per = B // backend.world_size
    rows = slice(backend.rank * per, (backend.rank + 1) * per)
    model.train_step((X[rows], Y[rows]), F.mse_loss, opt)
    return model.gather_full_parameters()


def _reference(**options):
    ref = build(**options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(X), Y).backward()
    opt.step()
    return ref.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_one_rank_still_trains_with_max_norm(strategy):
    got, = spawn(lambda b: _train(b, strategy, max_norm=1.0), 1)
    want = _reference(max_norm=1.0)
    assert all((got[k] - want[k]).abs().max() <= 1e-10 for k in want)


@pytest.mark.parametrize("options", [{"padding_idx": 0}, {"sparse": True}, {}])
def test_embedding_without_max_norm_is_unaffected(options):
    results = spawn(lambda b: _train(b, "ddp", **options), 2)
    want = _reference(**options)
    for got in results:
        assert all((got[k] - want[k]).abs().max() <= 1e-10 for k in want)
