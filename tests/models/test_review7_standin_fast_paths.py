"""ZeRO-3 and FSDP: the check for reads of resharded parameters (stand_in_reads.py) must not
change which path torch's transformer modules take. nn.TransformerEncoder, nn.TransformerEncoderLayer
and nn.MultiheadAttention take a fused inference path (eval mode, grad off or their parameters
frozen) only while no TorchFunctionMode is active; an encoder given a key padding mask then
returns zeros at the padded positions, while its module-by-module path computes them. The check's
mode ran in the first call of each kind (every call with ``debug``), so the first evaluation of an
nn.TransformerEncoder came out 2.2 off the unwrapped model, and so did an nn.Transformer's output,
whose decoder reads those positions. Each call must now equal the unwrapped model (float64, 1e-12),
and the check must still refuse the reads it refused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import FSDPModel, ZeRO3Model
from tests.models.common import SEED_LOCK

# torch's encoder warns that its nested tensors (the fused path under test) are a prototype.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

WIDTH, SEQ, BATCH, VOCAB = 8, 5, 4, 11
EXACT = {"rtol": 0, "atol": 1e-12}


def encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(encoder_layer(), 2)

    def forward(self, x, mask):
        return self.enc(x, src_key_padding_mask=mask)


class Seq2Seq(nn.Module):
    """nn.Transformer given only the source's padding mask: the decoder attends to every
    position of the encoder's output, padded ones included."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(WIDTH, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, x, mask):
        return self.transformer(x, x.flip(1), src_key_padding_mask=mask)


class FrozenEncoderHead(nn.Module):
    """A frozen encoder kept in eval mode under a trainable head: torch takes the encoder's fused
    path in a training forward with grad, since none of its tensors requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.enc.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, mask):
        return self.head(self.enc(x, mask))


def built(model_class: type[nn.Module]) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return model_class().double()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[::2, -2:] = True
    return torch.randn(BATCH, SEQ, WIDTH, generator=g, dtype=torch.float64), mask


def evaluated(model_class, strategy, settings, calls: int = 2, debug: bool = False):
    """The outputs of ``calls`` identical eval calls without grad under ``strategy`` on 2 ranks."""
    x, mask = padded_batch()

    def run(backend):
        model = strategy(built(model_class), backend, **settings)
        model.eval()
        with torch.no_grad():
            return [model(x, mask) for _ in range(calls)]
    return spawn(run, 2, timeout=30, debug=debug)


def unwrapped_eval(model_class) -> torch.Tensor:
    model = built(model_class).eval()
    with torch.no_grad():
        return model(*padded_batch())


UNITS = {
    "fsdp-layers": (FSDPModel, {"auto_wrap_min_params": 20}),  # each layer a unit (hooked)
    "fsdp-root": (FSDPModel, {}),                               # one unit: hookless layers
    "fsdp-encoder": (FSDPModel, {"auto_wrap_policy": lambda module, name: name == "enc"}),
    # out_proj (72 parameters) kept gathered: MultiheadAttention reads it without calling it
    "zero3-kept-out-proj": (ZeRO3Model, {"replicate_below_numel": 100}),
}


@pytest.mark.parametrize("units", list(UNITS))
@pytest.mark.parametrize("debug", [False, True], ids=["first-call-checked", "debug"])
def test_every_eval_call_of_an_encoder_with_a_padding_mask_equals_the_unwrapped_model(units, debug):
    want = unwrapped_eval(Encoder)
    assert (want[::2, -2:] == 0).all()  # torch's fused path: zeros at the padded positions
    for outputs in evaluated(Encoder, *UNITS[units], calls=3, debug=debug):
        for output in outputs:
            torch.testing.assert_close(output, want, **EXACT)


@pytest.mark.parametrize("units", ["fsdp-layers", "fsdp-root"])
def test_an_nn_transformer_s_first_eval_call_equals_the_unwrapped_model(units):
    want = unwrapped_eval(Seq2Seq)
    for outputs in evaluated(Seq2Seq, *UNITS[units]):
        for output in outputs:
            torch.testing.assert_close(output, want, **EXACT)


def test_a_frozen_eval_encoder_in_a_training_forward_equals_the_unwrapped_model():
    x, mask = padded_batch()
    reference = built(FrozenEncoderHead)
    reference.enc.eval()
    want = reference(x, mask)

    def run(backend):
        model = FSDPModel(built(FrozenEncoderHead), backend, auto_wrap_min_params=20)
        model.wrapped_model.enc.eval()
        return [model(x, mask).detach() for _ in range(2)]
    for outputs in spawn(run, 2, timeout=30):
        for output in outputs:
            torch.testing.assert_close(output, want.detach(), **EXACT)


# ---- the check still refuses ---------------------------------------------------------------------
@pytest.mark.parametrize("strategy, settings", [
    (ZeRO3Model, {}),
    (FSDPModel, {"auto_wrap_policy": lambda module, name: name.endswith("out_proj")})],
    ids=["zero3", "fsdp-out-proj-unit"])
def test_a_multihead_attention_s_out_proj_in_a_unit_of_its_own_is_refused_in_eval(strategy, settings):
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj, whose hooks never gather it.
    refused = r"'enc\.layers\.0\.self_attn\.out_proj'.*read in the model's forward before the unit's"
    with pytest.raises(ConfigError, match=refused):
        evaluated(Encoder, strategy, settings)


class Unrolled(nn.Module):
    """An nn.Sequential made a unit, whose children the forward calls one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(encoder_layer())

    def forward(self, x, mask):
        return self.blocks[0](x, src_key_padding_mask=mask)


def test_a_layer_run_outside_its_unit_s_forward_is_refused_in_eval():
    with pytest.raises(ConfigError, match=r"unit 'blocks'.*'blocks\.0\..*' was read"):
        evaluated(Unrolled, FSDPModel, {"auto_wrap_policy": lambda module, name: name == "blocks"})


class TiedEncoderLM(nn.Module):
    """An encoder between an embedding and a head tied to it by hand, in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.enc = nn.TransformerEncoder(encoder_layer(), 1)

    def forward(self, ids, mask):
        return F.linear(self.enc(self.emb(ids), src_key_padding_mask=mask), self.emb.weight)


def test_a_head_tied_by_hand_around_an_encoder_is_refused_in_eval():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    mask = padded_batch()[1]

    def run(backend):
        model = FSDPModel(built(TiedEncoderLM), backend,
                          auto_wrap_policy=lambda module, name: name in ("emb", "enc"))
        model.eval()
        with torch.no_grad():
            return model(ids, mask)
    with pytest.raises(ConfigError, match=r"'emb\.weight' was read in the model's forward outside"):
        spawn(run, 2, timeout=30)
