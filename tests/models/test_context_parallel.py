"""Context (sequence) parallelism, the ``cp`` axis of HybridShardedModel: the dilated-attention LM
trained with each sequence split across cp ranks (attention as a ring) equals single-process
training (float64 1e-10), alone and with dp, tp, pp and ZeRO; forward and validation loss equal
the dense model's; bad configurations are ConfigErrors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attention.ring import RingDilatedAttention
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from tests.models.common import lm_loss, tiny_lm
from tests.models.test_hybrid import TOL, batches, check, train


@pytest.mark.parametrize("dp,pp,cp", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 2, 4),
                                      (4, 1, 2)])
def test_layout_with_cp_trains_like_one_process(dp, pp, cp):
    dims = ParallelDims(dp=dp, pp=pp, cp=cp)
    check(spawn(lambda b: train(b, dims), dims.world_size))


@pytest.mark.parametrize("dp,tp,pp,cp", [(1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (1, 2, 1, 4)])
def test_tensor_and_context_parallel_train_like_one_process(dp, tp, pp, cp):
    """Each tp rank's heads run as a ring over the cp ranks holding those heads: the rate-1
    branch's head group straddles the tp split, the rate-4 one puts a group on each head."""
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
    check(spawn(lambda b: train(b, dims), dims.world_size))


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_zero_shards_over_dp_and_cp(data_parallel):
    dims = ParallelDims(dp=2, cp=2)
    results = spawn(lambda b: train(b, dims, data_parallel, "gpipe"), dims.world_size)
    check(results)
    ddp = spawn(lambda b: train(b, dims), dims.world_size)
    # The optimizer state is split over the 4 replicas (dp x cp), not the 2 dp ranks.
    for (_, _, zero_mem), (_, _, ddp_mem) in zip(results, ddp):
        assert zero_mem["optimizer_state"] <= ddp_mem["optimizer_state"] / 4 + 64


@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 1), (1, 2)])
def test_forward_and_validation_loss_equal_the_dense_model(pp, tp):
    dense = tiny_lm()
    x, y = batches()[0]
    with torch.no_grad():
        expected_out, expected_loss = dense(x), lm_loss(dense(x), y)

    def run(b):
        model = HybridShardedModel(copy.deepcopy(dense), b, dims=ParallelDims(pp=pp, tp=tp, cp=2),
                                   num_microbatches=2)
        rings = [m for m in model.wrapped_model.modules() if isinstance(m, RingDilatedAttention)]
        return model(x), model.validation_loss(x, y, lm_loss), len(rings)

    for out, loss, rings in spawn(run, 2 * pp * tp):
        torch.testing.assert_close(out, expected_out, **TOL)
        torch.testing.assert_close(loss, expected_loss, **TOL)
        assert rings == 2 // pp  # every attention this rank holds runs as a ring


def test_cp_needs_dilated_attention():
    def run(b):
        HybridShardedModel(nn.Sequential(nn.Linear(4, 4)), b, dims=ParallelDims(cp=2))

    with pytest.raises(ConfigError, match="no DilatedAttention|has none"):
        spawn(run, 2)


def test_sequence_must_split_evenly():
    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(cp=4))
        x = torch.zeros(2, 10, dtype=torch.int64)
        model.train_step((x, x), lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(ConfigError, match="divisible by 4"):
        spawn(run, 4)




def test_ring_attention_of_another_group_is_moved_onto_the_cp_group():
    # A model whose attention already ran as a ring over another group (here the whole world of
    # dp x cp ranks) kept that group: each ring spanned both replicas, which hold different
    # batches. (This layout's segments happen not to cross replicas, so the outputs matched; the
    # rings' group is the contract.)
    dense = tiny_lm()
    inputs = [batch[0] for batch in batches()[:2]]  # one per replica
    with torch.no_grad():
        expected = [dense(x) for x in inputs]

    def run(b):
        model = copy.deepcopy(dense)
        for module in list(model.modules()):
            for name, child in module.named_children():
                if type(child).__name__ == "DilatedAttention":
                    setattr(module, name, RingDilatedAttention(child.segment_lengths, child.dilation_rates,
                                                               child.softmax_scale, backend=b))
        wrapped = HybridShardedModel(model, b, dims=ParallelDims(dp=2, cp=2))
        rings = [m for m in wrapped.wrapped_model.modules() if isinstance(m, RingDilatedAttention)]
        replica = wrapped.groups.dp_index
        on_cp_group = all(r.backend is wrapped.groups.cp for r in rings)
        return replica, wrapped(inputs[replica]), len(rings), on_cp_group

    for replica, out, count, on_cp_group in spawn(run, 4):
        torch.testing.assert_close(out, expected[replica], **TOL)
        assert count == 2 and on_cp_group


class DictOutput(nn.Module):
    """The LM with a dict output: its logits and their sigmoid, both (batch, seq, ...)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.sequence_shard = lm.sequence_shard

    def pipeline_layers(self):
        return self.lm.pipeline_layers()

    def forward(self, x):
        logits = self.lm(x)
        return {"logits": logits, "gate": logits.sigmoid()}


def test_a_structured_output_is_gathered_leaf_by_leaf():
    # It failed with AttributeError: 'dict' object has no attribute 'movedim'.
    dense = tiny_lm()
    x, _ = batches()[0]
    with torch.no_grad():
        expected = dense(x)

    def run(b):
        model = HybridShardedModel(DictOutput(copy.deepcopy(dense)), b, dims=ParallelDims(cp=2))
        with torch.no_grad():
            return model(x)

    for out in spawn(run, 2):
        assert list(out) == ["logits", "gate"]
        torch.testing.assert_close(out["logits"], expected, **TOL)
        torch.testing.assert_close(out["gate"], expected.sigmoid(), **TOL)


@pytest.mark.parametrize("penalty", [False, True])
def test_a_backward_by_hand_through_a_cp_output_names_train_step(penalty):
    # The gathered output had no graph: torch's "does not require grad", or, with a penalty over
    # the parameters, a step on the penalty's gradients alone (7.8e-3 off one process).
    x, y = batches()[0]

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(cp=2))
        loss = lm_loss(model(x), y)
        if penalty:
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        with pytest.raises(ConfigError, match=r"train_step"):
            loss.backward()
        return True

    assert all(spawn(run, 2))


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2)])
def test_a_key_padding_mask_is_sliced_with_the_tokens(dp, cp):
    """Only one input tensor could be given under cp, so a key padding mask ({"tokens": ...,
    "key_padding_mask": ...}, as the other strategies take it) was a ConfigError; every argument
    running along the sequence is now sliced, in train_step and in the model's forward."""
    dense = tiny_lm()
    data = []
    for step, (x, y) in enumerate(batches()):
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[0, 16 - 3 - step:] = True  # the first sequence right-padded, more each step
        data.append(({"tokens": x, "key_padding_mask": mask}, y))
    reference = copy.deepcopy(dense)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for inputs, y in data:
        loss = lm_loss(reference(**inputs), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    with torch.no_grad():
        expected_out = reference(**data[0][0])

    def run(b):
        model = HybridShardedModel(copy.deepcopy(dense), b, dims=ParallelDims(dp=dp, cp=cp))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        share, index = len(data[0][1]) // dp, model.data_parallel_coordinates()[1]
        rows = slice(index * share, (index + 1) * share)
        losses = [model.train_step(({k: v[rows] for k, v in inputs.items()}, y[rows]), lm_loss, opt)
                  for inputs, y in data]
        with torch.no_grad():
            out = model(**data[0][0]) if dp == 1 else None
        return losses, model.gather_full_parameters(), out

    for losses, params, out in spawn(run, dp * cp):
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-10
        assert all((params[n] - p).abs().max() < 1e-10 for n, p in reference.state_dict().items())
        assert out is None or (out - expected_out).abs().max() < 1e-10
