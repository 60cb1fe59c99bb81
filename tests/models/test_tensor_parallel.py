"""Tensor parallelism: each Megatron layer against its dense module, the LM under its default
plan against the dense LM (outputs and gradients, float64 1e-10), and the all-reduce count; the
vocab-parallel loss of half-precision logits against float32 F.cross_entropy (half an ulp)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention.multihead import MultiheadDilatedAttention
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              ShardedLayerNorm, VocabParallelEmbedding)
from distframe.models.tensor_parallel_attention import TensorParallelDilatedAttention
from distframe.models.tensor_parallel_loss import vocab_parallel_cross_entropy
from distframe.models.tensor_parallel_model import TensorParallelModel
from distframe.models.tensor_parallel_plan import default_tp_plan
from tests.models.common import lm_loss, tiny_lm

TOL = dict(rtol=1e-10, atol=1e-10)


def tokens(batch=4, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq), generator=g), torch.randint(0, 256, (batch, seq), generator=g)


def _chunk(t, dim, backend):
    return t.chunk(backend.world_size, dim=dim)[backend.rank]


# ---- layers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_column_then_row_equals_dense_mlp(world):
    torch.manual_seed(0)
    fc_in, fc_out = nn.Linear(6, 8).double(), nn.Linear(8, 5).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    dense_x = x.clone().requires_grad_()
    expected = fc_out(torch.tanh(fc_in(dense_x)))
    expected.square().sum().backward()

    def run(b):
        col = ColumnParallelLinear.from_dense(fc_in, b)
        row = RowParallelLinear.from_dense(fc_out, b)
        xi = x.clone().requires_grad_()
        y = row(torch.tanh(col(xi)))
        y.square().sum().backward()
        torch.testing.assert_close(y, expected, **TOL)
        torch.testing.assert_close(xi.grad, dense_x.grad, **TOL)
        torch.testing.assert_close(col.weight.grad, _chunk(fc_in.weight.grad, 0, b), **TOL)
        torch.testing.assert_close(col.bias.grad, _chunk(fc_in.bias.grad, 0, b), **TOL)
        torch.testing.assert_close(row.weight.grad, _chunk(fc_out.weight.grad, 1, b), **TOL)
        torch.testing.assert_close(row.bias.grad, fc_out.bias.grad, **TOL)
        return b.stats.calls["all_reduce"]

    # One all-reduce forward (g after the row layer), one backward (f before the column layer).
    assert spawn(run, world) == [2] * world


@pytest.mark.parametrize("gather_output,input_is_parallel", [(True, False)])
def test_column_gather_and_row_scatter(gather_output, input_is_parallel):
    torch.manual_seed(0)
    a, c = nn.Linear(4, 6).double(), nn.Linear(6, 2).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = c(a(x))

    def run(b):
        col = ColumnParallelLinear.from_dense(a, b, gather_output=gather_output)
        row = RowParallelLinear.from_dense(c, b, input_is_parallel=input_is_parallel)
        torch.testing.assert_close(row(col(x)), expected, **TOL)

    spawn(run, 2)


def test_vocab_parallel_embedding_and_cross_entropy():
    torch.manual_seed(0)
    emb = nn.Embedding(12, 5).double()
    ids = torch.randint(0, 12, (3, 7))
    logits = torch.randn(3, 7, 12, dtype=torch.float64, requires_grad=True)
    expected_loss = F.cross_entropy(logits.reshape(-1, 12), ids.reshape(-1))
    expected_loss.backward()
    out = emb(ids)
    out.square().sum().backward()

    def run(b):
        vocab = VocabParallelEmbedding.from_dense(emb, b)
        y = vocab(ids)
        y.square().sum().backward()
        torch.testing.assert_close(y, out, **TOL)
        torch.testing.assert_close(vocab.weight.grad, _chunk(emb.weight.grad, 0, b), **TOL)
        local = _chunk(logits.detach(), -1, b).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, ids, b)
        loss.backward()
        torch.testing.assert_close(loss, expected_loss.detach(), **TOL)
        torch.testing.assert_close(local.grad, _chunk(logits.grad, -1, b), **TOL)

    spawn(run, 3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy_ignores_padding_targets(reduction):
    # As F.cross_entropy: targets equal to ignore_index (-100, the usual label padding) add no
    # loss and no gradient, and the mean is over the other targets.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 12, (3, 7), generator=g)
    ids[0, :4] = -100
    ids[2, 1] = 5
    expected = F.cross_entropy(logits.transpose(1, 2), ids, reduction=reduction)
    expected.sum().backward()

    def run(b):
        local = _chunk(logits.detach(), -1, b).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, ids, b, reduction=reduction)
        loss.sum().backward()
        torch.testing.assert_close(loss, expected.detach(), **TOL)
        torch.testing.assert_close(local.grad, _chunk(logits.grad, -1, b), **TOL)

    spawn(run, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab,scale,offset,world", [
    (12, 1.0, 0.0, 3),           # small: bfloat16 statistics were off by up to 2 half-ulps
    (131072, 0.1, 0.0, 2),       # near-uniform: a float16 sum of exponentials overflows (inf)
    (32768, 2.0, 1000.0, 2),     # large logits
])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_vocab_parallel_cross_entropy_of_half_logits_is_computed_in_float32(dtype, vocab, scale, offset,
                                                                           world, reduction):
    # As F.cross_entropy on the gathered logits upcast to float32, rounded once to the logits'
    # dtype: within half a unit in the last place (plus float32's own rounding), for the loss and
    # for the gradient (whose smallest entries are float16 subnormals: half their spacing too).
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 4, vocab, generator=g) * scale + offset).to(dtype)
    ids = torch.randint(0, vocab, (2, 4), generator=g)
    ids[1, 2] = -100
    upcast = logits.float().requires_grad_()
    expected = F.cross_entropy(upcast.transpose(1, 2), ids, reduction=reduction)
    expected.sum().backward()
    info = torch.finfo(dtype)
    tol = dict(rtol=info.eps / 2 + 4 * torch.finfo(torch.float32).eps,
               atol=info.smallest_normal * info.eps / 2)

    def run(b):
        local = _chunk(logits, -1, b).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, ids, b, reduction=reduction)
        loss.sum().backward()
        assert loss.dtype == dtype and local.grad.dtype == dtype
        torch.testing.assert_close(loss.float(), expected.detach(), **tol)
        torch.testing.assert_close(local.grad.float(), _chunk(upcast.grad, -1, b), **tol)

    spawn(run, world)


def test_sharded_layer_norm():
    torch.manual_seed(0)
    norm = nn.LayerNorm(8).double()
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    norm(x).pow(3).sum().backward()

    def run(b):
        local_x = _chunk(x.detach(), -1, b).clone().requires_grad_()
        sharded = ShardedLayerNorm.from_dense(norm, b)
        y = sharded(local_x)
        y.pow(3).sum().backward()
        torch.testing.assert_close(y, _chunk(norm(x), -1, b).detach(), **TOL)
        torch.testing.assert_close(local_x.grad, _chunk(x.grad, -1, b), **TOL)
        torch.testing.assert_close(sharded.weight.grad, _chunk(norm.weight.grad, 0, b), **TOL)

    spawn(run, 2)


@pytest.mark.parametrize("world,heads,rates,as_mask", [(2, 4, (1, 2, 4), False), (4, 4, (1, 2, 4), False),
                                                       (2, 6, (1, 4, 2), False), (2, 4, (1, 2, 4), True)])
def test_attention_split_by_heads(world, heads, rates, as_mask):
    # as_mask: causality given as nn.TransformerEncoder gives it, the causal attn_mask
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(6 * heads, heads, segment_lengths=(4, 8, 16),
                                     dilation_rates=rates).double()
    x = torch.randn(2, 16, 6 * heads, dtype=torch.float64, requires_grad=True)
    expected, _ = attn(x, x, x, is_causal=True)
    expected.square().sum().backward()

    def run(b):
        tp = TensorParallelDilatedAttention(attn, b)
        xi = x.detach().clone().requires_grad_()
        future = torch.ones(16, 16, dtype=torch.bool).triu(1)
        causal = {"attn_mask": future} if as_mask else {"is_causal": True}
        y, _ = tp(xi, xi, xi, **causal)
        y.square().sum().backward()
        torch.testing.assert_close(y, expected.detach(), **TOL)
        torch.testing.assert_close(xi.grad, x.grad, **TOL)
        torch.testing.assert_close(tp.q_proj.weight.grad, _chunk(attn.q_proj.weight.grad, 0, b), **TOL)
        torch.testing.assert_close(tp.out_proj.weight.grad, _chunk(attn.out_proj.weight.grad, 1, b), **TOL)

    spawn(run, world)


# ---- the LM under TensorParallelModel ----------------------------------------------------------
@pytest.mark.parametrize("world,tie", [(2, True), (4, True), (2, False)])
def test_lm_outputs_and_gradients_equal_dense(world, tie):
    reference = tiny_lm(tie=tie)
    x, y = tokens()
    dense = copy.deepcopy(reference)
    dense_out = dense(x)
    lm_loss(dense_out, y).backward()
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}

    def run(b):
        model = TensorParallelModel(copy.deepcopy(reference), b)
        torch.testing.assert_close(model(x), dense_out.detach(), **TOL)
        model.forward_backward((x, y), lm_loss)
        for lp in model.local_parameters:
            want = dense_grads[lp.name]
            if lp.split_dim is not None:
                want = want.chunk(world, dim=lp.split_dim)[b.rank]
            torch.testing.assert_close(lp.param.grad, want, **TOL, msg=lp.name)
        full = model.gather_full_parameters()
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(full[name], tensor, **TOL)
        return sum(p.numel() for p in model.parameters())

    held = spawn(run, world)
    assert max(held) < sum(p.numel() for p in reference.parameters())


def _count_step(b, reference, x, y):
    model = TensorParallelModel(copy.deepcopy(reference), b)
    b.stats.reset()
    model.forward_backward((x, y), lm_loss)
    return dict(b.stats.calls), dict(b.stats.bytes)


def test_megatron_all_reduce_count():
    """Per block: one (B,T,E) all-reduce forward and one backward in attention and in the MLP
    (4 in all); plus the sub-LN's (B,T,1) statistics; the embedding's one forward all-reduce."""
    layers = 3
    reference = tiny_lm(num_layers=layers)
    x, y = tokens()
    calls, nbytes = spawn(lambda b: _count_step(b, reference, x, y), 2)[0]
    activation = x.numel() * 16 * 8  # (B, T, E) float64
    statistic = x.numel() * 8        # (B, T, 1)
    big = 4 * layers + 1 + 1         # blocks, embedding forward, head input f backward
    small = 4 * layers               # sub-LN mean and variance, forward and backward
    assert calls["all_reduce"] == big + small
    assert nbytes["all_reduce"] == big * activation + small * statistic
    assert calls["all_gather"] == 1  # the logits, for an unmodified loss_fn


def test_plan_errors():
    with pytest.raises(ConfigError, match="not a submodule"):
        spawn(lambda b: TensorParallelModel(tiny_lm(), b, plan={"nope": "column"}), 2)
    with pytest.raises(ConfigError, match="choose one of"):
        spawn(lambda b: TensorParallelModel(tiny_lm(), b, plan={"head": "diagonal"}), 2)
    with pytest.raises(ConfigError, match="divisible"):
        spawn(lambda b: TensorParallelModel(tiny_lm(), b), 3)
    with pytest.raises(ConfigError, match="default tensor-parallel plan"):
        default_tp_plan(nn.Linear(2, 2))


@pytest.mark.parametrize("pp", [1, 2])
def test_tied_weight_planned_on_one_side_only_is_a_config_error(pp):
    # Splitting the head alone would cut the tie: the embedding would keep the whole weight and
    # train it apart from the head's slice (or, pipelined, all-reduce tensors of two shapes).
    from distframe.mesh import ParallelDims
    from distframe.models.hybrid import HybridShardedModel

    def run(b):
        HybridShardedModel(tiny_lm(), b, dims=ParallelDims(tp=2, pp=pp), tp_plan={"head": "column"})

    with pytest.raises(ConfigError, match="tok_embedding"):
        spawn(run, 2 * pp, timeout=20)
