"""Three things an expert does to an attention module that gave wrong answers without a word:
- a gradient penalty (backward with create_graph=True): the fused backward's result carried no
  graph, so the penalty's dependence on q, k and v was dropped;
- changing segment_lengths / dilation_rates after a forward: the cached layouts kept the old ones;
- moving a RingDilatedAttention to another backend (``ring.backend = group``, as context
  parallelism does): its cached key sources kept exchanging over the old group.
Plus: an unbatched input with the causal mask was blamed on the mask."""
import pytest
import torch

from attention import DilatedAttention, MultiheadDilatedAttention, RingDilatedAttention
from attention.reference import dense_dilated_attention
from distframe.launch import spawn
from attention_helpers import max_error, random_qkv

BRANCHES = [((4, 8), (1, 2)), ((8,), (2,))]


def penalty_gradients(attention, q, k, v, w):
    """d/d(q, k, v, w) of |d sum(out * w) / dq|^2: a gradient penalty through the attention."""
    out = attention(q, k, v)
    grad_q, = torch.autograd.grad((out * w).sum(), q, create_graph=True)
    return torch.autograd.grad(grad_q.pow(2).sum(), (q, k, v, w))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("segments,rates", BRANCHES)
def test_gradient_penalty_equals_the_dense_formula(segments, rates, is_causal, masked):
    q, k, v = random_qkv(2, 8, 4, 3)
    w = torch.randn(2, 8, 4, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True
    padding = mask if masked else None
    module = DilatedAttention(segments, rates)
    ours = penalty_gradients(lambda a, b, c: module(a, b, c, is_causal, padding), q, k, v, w)
    dense = penalty_gradients(lambda a, b, c: dense_dilated_attention(
        a, b, c, segments, rates, is_causal=is_causal, key_padding_mask=padding), q, k, v, w)
    assert max_error(ours, dense) < 1e-10
    assert max(g.abs().max().item() for g in dense[1:3]) > 1e-3   # k and v do get a gradient


@pytest.mark.parametrize("is_causal, padded", [(True, slice(0, 3)), (False, slice(0, 4))])
def test_gradient_penalty_is_exact_where_a_query_sees_no_key(is_causal, padded):
    # Left padding under the causal mask, or a whole segment padded, leaves query rows with no
    # key: their logsumexp over -inf alone put NaN into every second-order gradient.
    q, k, v = random_qkv(2, 8, 4, 3)
    w = torch.randn(2, 8, 4, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, padded] = True
    module = DilatedAttention((4, 8), (1, 2))
    ours = penalty_gradients(lambda a, b, c: module(a, b, c, is_causal, mask), q, k, v, w)
    dense = penalty_gradients(lambda a, b, c: dense_dilated_attention(
        a, b, c, (4, 8), (1, 2), is_causal=is_causal, key_padding_mask=mask), q, k, v, w)
    assert not any(g.isnan().any() for g in ours)
    assert max_error(ours, dense) < 1e-10


def shared_input_penalty(attention, x, w, roles):
    """A gradient penalty through attention(q, k, v) where the roles come from one tensor x as
    ``roles(x)`` says (self-attention ``x, x, x``, or views of a fused projection)."""
    out = attention(*roles(x))
    grad_x, = torch.autograd.grad((out * w).sum(), x, create_graph=True)
    return (grad_x, *torch.autograd.grad(grad_x.pow(2).sum(), (x, w)))


FUSED = (2, 8, 2, 3, 3)  # (batch, seq, heads, head_dim, role): q, k and v of one projection


@pytest.mark.parametrize("roles, shape", [
    pytest.param(lambda x: (x, x, x), FUSED[:4], id="q-k-v-one-tensor"),
    pytest.param(lambda x: (x[..., 0], *[x[..., 1]] * 2), FUSED, id="k-v-one-view"),
    pytest.param(lambda x: x.unbind(-1), FUSED, id="fused-projection-views"),
    pytest.param(lambda x: (x[..., 0].transpose(1, 2).contiguous().transpose(1, 2), x[..., 1], x[..., 2]),
                 FUSED, id="transposed-query")])
def test_gradient_penalty_when_inputs_share_a_tensor(roles, shape):
    # The differentiable backward took the gradient with respect to the saved q, k and v: one
    # tensor in three roles got the whole gradient three times (3x the first-order gradient
    # under create_graph=True), and non-contiguous inputs, saved as contiguous copies made
    # without grad, had no graph ("does not require grad").
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*FUSED[:4], dtype=torch.float64, requires_grad=True)
    module = DilatedAttention((4, 8), (1, 2))
    ours = shared_input_penalty(lambda a, b, c: module(a, b, c, True), x, w, roles)
    dense = shared_input_penalty(lambda a, b, c: dense_dilated_attention(
        a, b, c, (4, 8), (1, 2), is_causal=True), x, w, roles)
    assert max_error(ours, dense) < 1e-10


def test_gradgradcheck_in_float64():
    q, k, v = random_qkv(1, 8, 2, 2)
    module = DilatedAttention((4, 8), (1, 2))
    assert torch.autograd.gradgradcheck(lambda a, b, c: module(a, b, c, True), (q, k, v))


def test_ring_refuses_a_differentiable_backward():
    def run(backend):
        q, k, v = (t[:, backend.rank * 4:(backend.rank + 1) * 4].detach().requires_grad_()
                   for t in random_qkv(1, 8, 2, 2))
        ring = RingDilatedAttention((8,), (2,), backend=backend)
        out = ring(q, k, v)
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(out.sum(), q, create_graph=True)
        return True

    assert all(spawn(run, 2))


def test_changed_branches_are_computed():
    q, k, v = random_qkv(1, 16, 2, 3)
    module = DilatedAttention((4,), (1,))
    module(q, k, v)
    module.segment_lengths, module.dilation_rates = (8, 16), (2, 4)
    want = dense_dilated_attention(q, k, v, (8, 16), (2, 4))
    assert max_error(module(q, k, v), want) < 1e-12


def test_ring_moved_to_another_backend_exchanges_over_it():
    """Pairs {0,1} and {2,3}, then {0,3} and {2,1}: every rank keeps its rank number in its pair,
    so only the group the keys travel over tells the two apart."""
    sequences = [random_qkv(1, 8, 2, 4, seed=s) for s in (1, 2)]
    want = [dense_dilated_attention(*qkv, (8,), (2,)) for qkv in sequences]

    def run(world):
        r = world.rank
        first = [world.new_group([0, 1]), world.new_group([2, 3])][r // 2]
        second = world.new_group([0, 3]), world.new_group([2, 1])
        second = second[0] if r in (0, 3) else second[1]
        errors = []
        ring = RingDilatedAttention((8,), (2,), backend=first)
        for group, which in ((first, r // 2), (second, 0 if r in (0, 3) else 1)):
            ring.backend = group
            part = slice(group.rank * 4, (group.rank + 1) * 4)
            out = ring(*(t[:, part].detach() for t in sequences[which]))
            errors.append(max_error(out, want[which][:, part]))
        return errors

    for errors in spawn(run, 4):
        assert max(errors) < 1e-12


def test_unbatched_input_is_named_before_the_mask():
    module = MultiheadDilatedAttention(8, 2, segment_lengths=(4,), dilation_rates=(1,))
    x = torch.randn(4, 8)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(4)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq, embed_dim\), got \(4, 8\)"):
        module(x, x, x, attn_mask=causal)
