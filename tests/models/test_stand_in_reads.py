"""ZeRO-3 and FSDP: a parameter read outside its unit's forward while the unit is resharded. It
holds a NaN stand-in then ([Note: parameters between uses] in sharded_unit.py); a head tied by
hand (``F.linear(h, self.emb.weight)`` after ``self.emb`` ran) or an L2 penalty over the
parameters in train_step's loss function read it, and every parameter trained into NaN without
a word. Such a read inside the model's forward or the loss function is now a ConfigError naming
the parameter and the fix; the legitimate patterns still train exactly as one process (float64)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import (SEED_LOCK, SETTINGS, STRATEGIES, build_model, global_batches, lm_loss,
                                 loss_fn, rank_slice)

VOCAB, WIDTH, STEPS = 11, 8, 2
SMALL_UNITS = {"zero3": {}, "fsdp": {"auto_wrap_min_params": 50}}  # emb and mid are units of their own


class TiedByHand(nn.Module):
    """An output projection tied to the embedding by hand, in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return F.linear(h, self.emb.weight)


class TiedByModule(TiedByHand):
    """The same model with the head a module registering the embedding's Parameter: both
    strategies put it in the unit of the modules' common ancestor, gathered for the whole forward.
    The forward also reads a resharded parameter's metadata, which is no read of its values."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        # The shape and dtype of the resharded 'mid.weight': its metadata, not its values.
        return self.head(h.reshape(*ids.shape, self.mid.weight.shape[0]).to(self.mid.weight.dtype))


def built(model_class: type[nn.Module]) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return model_class().double()


def token_batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g))
            for _ in range(steps)]


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def single_process(model: nn.Module, batches, loss) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trained(strategy: str, make_model, batches, loss, settings: dict):
    """Trains ``make_model()`` under ``strategy`` on 2 ranks: every rank's gathered parameters."""
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(make_model(), backend, **settings)
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss, opt)
        return model.gather_full_parameters()
    return spawn(run, 2, timeout=30)


def assert_same(results, reference) -> None:
    for params in results:
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


# ---- refused --------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_head_tied_by_hand_is_refused_naming_the_parameter(strategy):
    with pytest.raises(ConfigError, match=r"'emb\.weight'.*outside.*forward.*reshard_after_forward=False"):
        trained(strategy, lambda: built(TiedByHand), token_batches(), token_loss, SMALL_UNITS[strategy])


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_read_in_an_evaluation_without_grad_is_refused(strategy):
    def run(backend):
        model = STRATEGIES[strategy][0](built(TiedByHand), backend, **SMALL_UNITS[strategy])
        with torch.no_grad():
            return model(token_batches(1)[0][0])
    with pytest.raises(ConfigError, match=r"'emb\.weight'"):
        spawn(run, 2, timeout=30)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_parameter_penalty_in_the_loss_function_is_refused(strategy):
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        net = build_model()
        model = model_cls(net, backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)

        def loss(output, target):
            penalty = sum(p.pow(2).sum() for p in net.parameters())
            return loss_fn(output, target) + 1e-2 * penalty
        batch = rank_slice(global_batches(1, 4)[0], backend.rank, backend.world_size)
        model.train_step(batch, loss, opt)
    with pytest.raises(ConfigError, match=r"'0\.weight'.*loss function.*weight_decay"):
        spawn(run, 2, timeout=30)


class LateRead(TiedByHand):
    """Reads the embedding's weight outside its unit only once ``read_late`` is set."""

    read_late = False

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return F.linear(h, self.emb.weight) if self.read_late else h @ h.new_ones(WIDTH, VOCAB)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_backend_made_with_debug_checks_every_forward(strategy):
    # Without debug only the first forward of each kind is checked (its cost: [Note: which calls
    # are checked] in stand_in_reads.py); with it, a read on a path taken later is refused too.
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(built(LateRead), backend, **SMALL_UNITS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        for step, batch in enumerate(token_batches(3)):
            model.wrapped_model.read_late = step == 2
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), token_loss, opt)
    with pytest.raises(ConfigError, match=r"'emb\.weight'"):
        spawn(run, 2, timeout=30, debug=True)


class Scaled(nn.Module):
    """A linear layer and a one-element parameter (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, VOCAB)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.lin(x) / self.temperature


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_write_into_a_resharded_scalar_parameter_leaves_the_others_nan(strategy):
    # A one-element view is no overlap to torch, so fill_ wrote into the NaN that every resharded
    # parameter of the dtype expands: all of them then read 0.5, a plausible number.
    def run(backend):
        model = STRATEGIES[strategy][0](built(Scaled), backend, **SMALL_UNITS[strategy])
        model(torch.randn(2, WIDTH, dtype=torch.float64))
        with torch.no_grad():
            model.wrapped_model.temperature.fill_(0.5)
        return model.wrapped_model.lin.weight.detach().clone()
    for weight in spawn(run, 2, timeout=30):
        assert torch.isnan(weight).all()


# ---- still exact ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_shared_unit_holding_both_tied_modules_trains_exactly(strategy):
    batches = token_batches()
    reference = single_process(built(TiedByHand), batches, token_loss)   # the same values, tied by hand
    assert_same(trained(strategy, lambda: built(TiedByModule), batches, token_loss, SMALL_UNITS[strategy]),
                reference)


@pytest.mark.parametrize("strategy, settings", [
    ("zero3", {"reshard_after_forward": False}),
    ("fsdp", {"auto_wrap_min_params": 50, "reshard_after_forward": False}),
    ("fsdp", {"auto_wrap_policy": lambda module, name: name == "mid"})],   # emb.weight in the root unit
    ids=["zero3-kept", "fsdp-kept", "fsdp-policy"])
def test_the_fixes_the_error_names_train_a_head_tied_by_hand_exactly(strategy, settings):
    batches = token_batches()
    reference = single_process(built(TiedByHand), batches, token_loss)
    assert_same(trained(strategy, lambda: built(TiedByHand), batches, token_loss, settings), reference)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_parameter_penalty_trains_exactly_with_units_kept_gathered_until_backward(strategy):
    # The fix the error names for the loss function (besides the optimizer's weight_decay).
    def penalised(model):
        def loss(output, target):
            return loss_fn(output, target) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
        return loss
    batches = global_batches(STEPS, 4)
    model = build_model()
    reference = single_process(model, batches, penalised(model))

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        net = build_model()
        model = model_cls(net, backend, **SETTINGS[strategy], reshard_after_forward=False)
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        for batch in batches:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), penalised(net), opt)
        return model.gather_full_parameters()
    assert_same(spawn(run, 2, timeout=30), reference)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_strategies_normal_use_trains_exactly(strategy):
    batches = global_batches(STEPS, 4)
    reference = single_process(build_model(), batches, loss_fn)
    assert_same(trained(strategy, build_model, batches, loss_fn, SETTINGS[strategy]), reference)


def checkpointed_lm() -> DilatedTransformerLM:
    """The tiny LM, tied (head and embedding in one shared unit), its blocks checkpointed."""
    config = DilatedTransformerConfig.preset(
        "tiny", seq_len=16, embed_dim=16, num_heads=4, num_layers=2, segment_lengths=(4, 8, 16),
        dilation_rates=(1, 2, 4), tie_embeddings=True, activation_checkpointing=True)
    with SEED_LOCK:
        torch.manual_seed(0)
        return DilatedTransformerLM(config).double()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_activation_checkpointing_with_a_tied_head_trains_exactly(strategy):
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
               for _ in range(STEPS)]
    reference = single_process(checkpointed_lm(), batches, lm_loss)
    assert_same(trained(strategy, checkpointed_lm, batches, lm_loss, SETTINGS[strategy]), reference)
