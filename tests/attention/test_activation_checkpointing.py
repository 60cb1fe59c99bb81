"""DilatedTransformerConfig(activation_checkpointing=True): each block keeps only its input and
recomputes the rest in backward. Outputs and gradients equal the plain model's bit for bit, with
dropout on, whether masks come from torch's global generator or from a generator of a module's
own (dropout_generator), whose stream then goes on as though nothing had been recomputed."""
import pytest
import torch
from torch import nn

from attention import DilatedAttention
from attention.model import DilatedTransformerConfig, DilatedTransformerLM


class OwnGeneratorAttention(DilatedAttention):
    """Draws its attention-dropout decisions from a generator of its own (as the main job's
    per-rank generators do)."""

    def __init__(self, dense: DilatedAttention, generator: torch.Generator) -> None:
        super().__init__(dense.segment_lengths, dense.dilation_rates,
                         attention_dropout=dense.attention_dropout)
        self.generator = generator

    def dropout_generator(self, device):
        return self.generator


def lm(checkpointing: bool, own_generator: bool) -> tuple[DilatedTransformerLM, torch.Generator | None]:
    config = DilatedTransformerConfig.preset("tiny", seq_len=16, embed_dim=16, num_heads=4,
                                             segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4),
                                             dropout=0.2, activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = DilatedTransformerLM(config).double()
    generator = None
    if own_generator:
        generator = torch.Generator().manual_seed(5)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is DilatedAttention:
                    setattr(parent, name, OwnGeneratorAttention(child, generator))
    return model, generator


@pytest.mark.parametrize("own_generator", [False, True])
def test_gradients_equal_the_plain_model_with_dropout(own_generator):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointing in (False, True):
        model, generator = lm(checkpointing, own_generator)
        torch.manual_seed(7)
        losses = []
        for _ in range(2):   # the second step's masks follow from the first's streams
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((losses, grads, None if generator is None else generator.get_state()))
    (plain_losses, plain_grads, plain_state), (losses, grads, state) = results
    assert losses == plain_losses
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    if own_generator:
        assert torch.equal(state, plain_state)   # the stream went on as without recomputation


def test_checkpointing_keeps_fewer_activations():
    def saved_bytes(checkpointing):
        model, _ = lm(checkpointing, False)
        total = [0]

        def pack(tensor):
            total[0] += tensor.numel() * tensor.element_size()
            return tensor
        tokens = torch.randint(0, 256, (2, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens).sum()
        return total[0]

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


def test_the_setting_must_be_a_bool():
    with pytest.raises(ValueError, match="activation_checkpointing must be True or False"):
        DilatedTransformerConfig(activation_checkpointing="yes")
