"""Dilated attention compiled as one operator ([Note: dilated attention as an operator] in
attention/compiled_op.py): ``torch.library.opcheck`` on both operators (schema, fake rule,
autograd, AOTAutograd with dynamic shapes); modules compiled with ``fullgraph=True`` (no graph
break: the operator was taken) equal the dense reference (float64 1e-10) and the uncompiled module
(1e-12), causal or not, padded or not, every head or a tensor-parallel rank's; and the cases it
must not take (attention dropout in training, the ring) still break the graph and stay exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention import DilatedAttention, dense_dilated_attention
from attention.model import DilatedTransformerLM
from attention_helpers import max_error, outputs_and_grads, random_qkv, tiny_lm_config
from distframe.models.tensor_parallel_attention import HeadShardedDilatedAttention

COMPILER = "aot_eager"  # AOTAutograd without a C compiler
CASES = [  # segments, rates, heads, seq
    ((4, 8), (1, 2), 4, 16),
    ((3, 6, 12), (1, 2, 4), 3, 17),  # ragged segment, heads not divisible by a rate
    ((8, 16, 32), (1, 2, 4), 5, 20),  # segments longer than the sequence
]


def _inputs(heads, seq, padded, seed=0, dtype=torch.float64):
    q, k, v = random_qkv(2, seq, heads, 4, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(2, seq, generator=gen) < 0.3) if padded else None
    return q, k, v, mask, torch.randn(q.shape, dtype=dtype, generator=gen)


@pytest.mark.parametrize("segments,rates,heads,seq", CASES)
@pytest.mark.parametrize("causal,padded", [(False, False), (True, True), (True, False)])
def test_operators_pass_opcheck(segments, rates, heads, seq, causal, padded):
    q, k, v, mask, grad_out = _inputs(heads, seq, padded)
    config = (list(segments), list(rates), causal, 4 ** -0.5, 0, heads)
    torch.library.opcheck(torch.ops.distframe.dilated_attention.default, (q, k, v, mask, *config))
    out, lse = torch.ops.distframe.dilated_attention(q, k, v, mask, *config)
    torch.library.opcheck(torch.ops.distframe.dilated_attention_backward.default,
                          (grad_out, q.detach(), k.detach(), v.detach(), mask, out.detach(), lse, *config))


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("segments,rates,heads,seq", CASES)
@pytest.mark.parametrize("causal,padded", [(False, False), (True, True), (False, True)])
def test_compiled_module_is_one_graph_and_exact(segments, rates, heads, seq, causal, padded):
    q, k, v, mask, grad_out = _inputs(heads, seq, padded)
    module = DilatedAttention(segments, rates)
    torch._dynamo.reset()
    graphs = _graphs()
    compiled = torch.compile(lambda *t: module(*t, is_causal=causal, key_padding_mask=mask),
                             backend=COMPILER, fullgraph=True)  # fullgraph: a break would raise
    out, grads = outputs_and_grads(compiled, (q, k, v), grad_out)
    eager, eager_grads = outputs_and_grads(
        lambda *t: module(*t, is_causal=causal, key_padding_mask=mask), (q, k, v), grad_out)
    ref, ref_grads = outputs_and_grads(
        lambda *t: dense_dilated_attention(*t, segments, rates, is_causal=causal, key_padding_mask=mask),
        (q, k, v), grad_out)
    assert max_error(out, ref) < 1e-10 and max_error(grads, ref_grads) < 1e-10
    assert max_error(out, eager) < 1e-12 and max_error(grads, eager_grads) < 1e-12
    assert _graphs() - graphs == 1


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6),
                                             (torch.bfloat16, 0.0)])
def test_compiled_rank_of_a_head_split_reads_the_full_modules_heads(dtype, tolerance):
    """A tensor-parallel rank holding heads 2..3 of 5 (the operator's ``head_start`` and
    ``total_heads``) gives those heads of the full module, compiled as uncompiled."""
    q, k, v, mask, grad_out = _inputs(5, 20, True, dtype=dtype)
    full = DilatedAttention((8, 16), (1, 2))
    rank = HeadShardedDilatedAttention(full, head_start=2, total_heads=5)
    heads = [t[:, :, 2:4].detach().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: rank(*t, is_causal=True, key_padding_mask=mask),
                             backend=COMPILER, fullgraph=True)
    out, grads = outputs_and_grads(compiled, heads, grad_out[:, :, 2:4])
    eager, eager_grads = outputs_and_grads(lambda *t: rank(*t, is_causal=True, key_padding_mask=mask),
                                           heads, grad_out[:, :, 2:4])
    assert max_error(out, eager) <= tolerance and max_error(grads, eager_grads) <= tolerance
    whole = full(q, k, v, is_causal=True, key_padding_mask=mask)
    assert max_error(out, whole[:, :, 2:4]) <= max(tolerance, 1e-12)


def test_attention_dropout_in_training_breaks_the_graph_and_draws_its_masks():
    """The operator sees no generator: with attention dropout in training the call runs
    uncompiled (a graph break, so ``fullgraph=True`` refuses) and draws the masks it draws
    uncompiled; in evaluation mode the operator stands in again."""
    q, k, v, _, grad_out = _inputs(4, 16, False)
    module = DilatedAttention((4, 8), (1, 2), attention_dropout=0.3)
    torch._dynamo.reset()
    from torch._dynamo.exc import Unsupported
    with pytest.raises(Unsupported, match="_forward_uncompiled"):
        torch.compile(module, backend=COMPILER, fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=COMPILER)
    torch.manual_seed(3)
    out, grads = outputs_and_grads(compiled, (q, k, v), grad_out)
    torch.manual_seed(3)
    eager, eager_grads = outputs_and_grads(module, (q, k, v), grad_out)
    assert max_error(out, eager) < 1e-12 and max_error(grads, eager_grads) < 1e-12
    module.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        evaluated = torch.compile(module, backend=COMPILER, fullgraph=True)(q, k, v)
        assert max_error(evaluated, module(q, k, v)) < 1e-12


def _lm_losses(compiled: bool, fullgraph: bool, steps: int = 3, prepare=None, **overrides) -> list[float]:
    """Losses of ``steps`` AdamW steps with key padding; ``prepare(block)`` first edits each block."""
    torch.manual_seed(0)
    model = DilatedTransformerLM(tiny_lm_config(**overrides)).double()
    for block in model.blocks:
        block.attn.attention.attention_dropout = 0.0  # the blocks' nn.Dropout stay: in the graph
        if prepare is not None:
            prepare(block)
        if compiled:
            block.compile(backend=COMPILER, fullgraph=fullgraph)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randint(0, 64, (4, 32), generator=tokens)
        mask = torch.zeros(4, 32, dtype=torch.bool)
        mask[step % 4, -3:] = True
        loss = F.cross_entropy(model(x, key_padding_mask=mask).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("overrides", [{}, {"activation_checkpointing": True}, {"dropout": 0.1},
                                       {"dropout": 0.1, "activation_checkpointing": True}])
def test_blocks_compile_whole_and_train_as_uncompiled(overrides):
    """Every block one graph (``fullgraph=True``), a checkpointed one too ([Note: activation
    checkpointing under torch.compile] in attention/recompute.py), with key padding and with the
    blocks' dropout (attention dropout off: it would break the graph): the losses of three AdamW
    steps equal the uncompiled run's (float64 1e-12), so the checkpointed graph kept the masks
    its forward drew."""
    torch._dynamo.reset()
    expected = _lm_losses(False, False, **overrides)
    assert _lm_losses(True, True, **overrides) == pytest.approx(expected, rel=0, abs=1e-12)


def test_compiled_blocks_follow_the_sequence_length():
    """Lengths that change between calls (evaluation on shorter text, ragged last segments):
    Dynamo recompiles once with a symbolic length, which the operator's fake rule takes; outputs
    and gradients equal the uncompiled LM's at every length."""
    config = tiny_lm_config()
    torch.manual_seed(0)
    model = DilatedTransformerLM(config).double()
    reference = DilatedTransformerLM(config).double()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    graphs = _graphs()
    for block in model.blocks:
        block.compile(backend=COMPILER, fullgraph=True)
    for length in (32, 24, 13, 32):
        x = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        out, expected = model(x), reference(x)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert max_error(out, expected) < 1e-12
        assert max_error([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]) < 1e-12
    assert _graphs() - graphs == 2  # the first length, then one graph for every length


class _OwnGeneratorAttention(DilatedAttention):
    """Names a generator of its own, as the main job's per-rank attention does."""

    def __init__(self, dense: DilatedAttention) -> None:
        super().__init__(dense.segment_lengths, dense.dilation_rates)
        self.generator = torch.Generator().manual_seed(7)

    def dropout_generator(self, device):
        return self.generator


def test_checkpointed_block_with_its_own_generator_checkpoints_uncompiled():
    """A block one of whose modules draws from its own generator is checkpointed as uncompiled
    (``checkpoint_with_same_masks``, which Dynamo skips): traced, torch.compile refuses its
    generator-restoring contexts. Here without dropout, so the rest of the block is traceable
    and only that skip keeps the compile from failing; the losses equal the uncompiled run's."""
    def own_generator(block):
        block.attn.attention = _OwnGeneratorAttention(block.attn.attention)

    torch._dynamo.reset()
    expected = _lm_losses(False, False, steps=2, prepare=own_generator, activation_checkpointing=True)
    assert _lm_losses(True, False, steps=2, prepare=own_generator,
                      activation_checkpointing=True) == pytest.approx(expected, rel=0, abs=1e-12)


def test_a_block_exports_with_the_operator_in_its_graph():
    """``torch.export`` of a block (what the README says works): the graph holds the operator,
    and the exported program computes what the block computes."""
    config = tiny_lm_config()
    torch.manual_seed(0)
    block = DilatedTransformerLM(config).double().eval().blocks[0]
    x = torch.randn(2, 32, config.embed_dim, dtype=torch.float64)
    exported = torch.export.export(block, (x,))
    targets = {str(node.target) for node in exported.graph.nodes}
    assert "distframe.dilated_attention.default" in targets, targets
    with torch.no_grad():
        assert max_error(exported.module()(x), block(x)) < 1e-12


@pytest.mark.parametrize("how", ["compile", "export"])
def test_the_whole_lm_is_one_graph_and_still_refuses_ids_outside_its_vocabulary(how):
    """The LM's token-id check branched on the ids' values, which a graph cannot: compiled or
    exported it is an assertion op, so the whole LM compiles with ``fullgraph=True`` and exports,
    and ids outside the vocabulary still stop it with the check's words (a RuntimeError here;
    uncompiled, an IndexError)."""
    config = tiny_lm_config()
    torch.manual_seed(0)
    model = DilatedTransformerLM(config).double().eval()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    run = (torch.compile(model, backend=COMPILER, fullgraph=True) if how == "compile"
           else torch.export.export(model, (x,)).module())
    with torch.no_grad():
        assert max_error(run(x), model(x)) < 1e-12
        with pytest.raises(RuntimeError, match=r"token ids outside its vocabulary \[0, 64\)"):
            run(torch.full((2, 32), 64))
