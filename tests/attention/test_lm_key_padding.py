"""``DilatedTransformerLM(tokens, key_padding_mask=...)``: a batch of padded sequences through the LM.

The mask is ``(batch, seq)`` bool, True marking a padding token, and hides those keys in every
attention layer; positions are not shifted. Right padding (what training uses) gives each
sequence's logits as if it were run alone; a padded key, wherever it sits, changes no unpadded
position's logits. Everything in float64 so that agreement can be asked to 1e-12 or exactly.
"""
import pytest
import torch

from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from distframe.models.stages import pipeline_layers

SEQ, PAD = 32, 0  # the pad id occurs nowhere else, so its embedding row shows where gradients go


def tiny_lm(**overrides) -> DilatedTransformerLM:
    config = DilatedTransformerConfig.preset(
        "tiny", seq_len=SEQ, embed_dim=16, num_heads=4, segment_lengths=(8, 16, 32),
        dilation_rates=(1, 2, 4), **overrides)
    torch.manual_seed(0)
    return DilatedTransformerLM(config).double().eval()


def sequences(lengths, seed=1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=generator) for n in lengths]


def padded(seqs, side="right") -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)`` of ``seqs`` padded with PAD to SEQ on ``side``."""
    tokens = torch.full((len(seqs), SEQ), PAD)
    mask = torch.ones(len(seqs), SEQ, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        part = slice(0, len(seq)) if side == "right" else slice(SEQ - len(seq), SEQ)
        tokens[i, part], mask[i, part] = seq, False
    return tokens, mask


LENGTHS = (SEQ, 21, 9, 1)


def test_right_padded_logits_equal_each_sequence_run_alone():
    model = tiny_lm()
    seqs = sequences(LENGTHS)
    tokens, mask = padded(seqs)
    with torch.no_grad():
        logits = model(tokens, key_padding_mask=mask)
        for i, seq in enumerate(seqs):
            alone = model(seq[None])[0]
            assert (logits[i, :len(seq)] - alone).abs().max() < 1e-12, len(seq)


def scattered_mask() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(len(LENGTHS), SEQ, generator=generator) < 0.4
    mask[:, 5] = False  # every row keeps a token
    return mask


@pytest.mark.parametrize("side", ["right", "left", "scattered"])
def test_tokens_at_padded_positions_change_no_unpadded_logit(side):
    """Left padding puts the pads before the tokens that must not read them: without the mask
    every later token attended to them."""
    model = tiny_lm()
    if side == "scattered":
        mask = scattered_mask()
        tokens = torch.where(mask, PAD, torch.randint(1, 256, mask.shape))
    else:
        tokens, mask = padded(sequences(LENGTHS), side)
    other = torch.where(mask, torch.randint(1, 256, mask.shape), tokens)
    assert not torch.equal(other, tokens)
    with torch.no_grad():
        logits = model(tokens, key_padding_mask=mask)
        changed = model(other, key_padding_mask=mask)
    assert torch.equal(logits[~mask], changed[~mask])
    assert torch.isfinite(logits).all()


def test_gradients_come_from_unpadded_positions_only():
    """Left padding: a loss over the unpadded positions sends no gradient to the pad token's
    embedding nor to the positions the pads hold; right padding: the batch's gradients are the
    sum of each sequence's run alone."""
    model = tiny_lm(tie_embeddings=False)
    seqs = sequences(LENGTHS)
    tokens, mask = padded(seqs[1:], "left")
    model(tokens, key_padding_mask=mask)[~mask].sum().backward()
    assert torch.equal(model.tok_embedding.weight.grad[PAD], torch.zeros(16, dtype=torch.float64))
    first = SEQ - max(len(s) for s in seqs[1:])  # positions before it hold pads in every row
    position_grads = model.pos_embedding.weight.grad
    assert torch.equal(position_grads[:first], torch.zeros_like(position_grads[:first]))
    assert (position_grads[first:].abs().sum(1) > 0).all()
    model.zero_grad()
    tokens, mask = padded(seqs[1:], "right")
    model(tokens, key_padding_mask=mask)[~mask].sum().backward()
    batch = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for seq in seqs[1:]:
        model(seq[None]).sum().backward()
    for name, p in model.named_parameters():
        assert (batch[name] - p.grad).abs().max() < 1e-12, name


@pytest.mark.parametrize("mask, message", [
    (torch.zeros(4, SEQ + 1, dtype=torch.bool), r"got shape \(4, 33\)"),
    (torch.zeros(SEQ, dtype=torch.bool), r"got shape \(32,\)"),
    (torch.zeros(4, SEQ, 1, dtype=torch.bool), r"got shape \(4, 32, 1\)"),
    (torch.zeros(4, SEQ, dtype=torch.int64), r"got torch.int64.*attention_mask == 0"),
    (torch.zeros(4, SEQ), r"got torch.float32.*mask == -inf"),
    ([[False] * SEQ] * 4, r"got list"),
])
def test_a_bad_mask_is_a_value_error_naming_what_to_pass(mask, message):
    model = tiny_lm()
    tokens = torch.randint(0, 256, (4, SEQ))
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor of shape "
                                         r"\(batch, seq\) = \(4, 32\), True marking padding.*" + message):
        model(tokens, key_padding_mask=mask)


def test_a_mask_on_another_device_is_a_value_error():
    model = tiny_lm()
    mask = torch.zeros(2, SEQ, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta.*tokens are on cpu"):
        model(torch.randint(0, 256, (2, SEQ)), key_padding_mask=mask)


def test_no_mask_gives_the_output_of_the_layers_the_pipelines_run():
    """``key_padding_mask=None`` is the model as it was: the pipeline stages' layers (embedding,
    blocks, head, each called on one tensor) run in order give the same logits bit for bit; a
    mask with no padding gives them too."""
    model = tiny_lm()
    tokens = torch.randint(0, 256, (3, SEQ))
    with torch.no_grad():
        x = tokens
        for _, layer in pipeline_layers(model):
            x = layer(x)
        assert torch.equal(model(tokens), x)
        assert torch.equal(model(tokens, key_padding_mask=None), x)
        none_padded = torch.zeros(3, SEQ, dtype=torch.bool)
        assert (model(tokens, key_padding_mask=none_padded) - x).abs().max() < 1e-12


def test_a_fully_padded_row_gives_finite_logits_and_changes_no_other_row():
    model = tiny_lm()
    tokens, mask = padded(sequences(LENGTHS))
    mask[2] = True
    with torch.no_grad():
        logits = model(tokens, key_padding_mask=mask)
        rest = model(tokens[[0, 1, 3]], key_padding_mask=mask[[0, 1, 3]])
    assert torch.isfinite(logits).all()
    assert (logits[[0, 1, 3]] - rest).abs().max() < 1e-12


def test_activation_checkpointing_with_a_mask_gives_the_plain_gradients():
    tokens, mask = padded(sequences(LENGTHS), "left")
    grads = []
    for checkpointing in (False, True):
        model = tiny_lm(activation_checkpointing=checkpointing, dropout=0.1).train()
        torch.manual_seed(7)
        model(tokens, key_padding_mask=mask)[~mask].sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
