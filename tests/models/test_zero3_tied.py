"""Tied parameters (one Parameter used by several modules) under ZeRO-3 and FSDP: training equals
one process, the shared weight is stored and reduced once, and checkpoints keep DDP's names."""
import pytest
import torch
from torch import nn

from attention.model import DilatedTransformerConfig, DilatedTransformerLM
from distframe import checkpoint
from distframe.checkpoint.format import read_metadata
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES

STEPS, BATCH, VOCAB, SEQ = 5, 6, 16, 8


class TiedPair(nn.Module):
    """The smallest tied model: an embedding whose weight is also the output head's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def tiny_lm() -> nn.Module:
    config = DilatedTransformerConfig(vocab_size=VOCAB, seq_len=SEQ, embed_dim=8, num_heads=2,
                                      num_layers=2, segment_lengths=(4, 8), dilation_rates=(1, 2))
    return DilatedTransformerLM(config)


MODELS = {"pair": TiedPair, "lm": tiny_lm}


def every_child_its_own_unit(module, name):
    """An FSDP policy that puts the tied users in different units (the weight must leave them)."""
    return True


SPLITTING_POLICY = every_child_its_own_unit
CASES = [("zero3", {}), ("fsdp", {}), ("fsdp", {"auto_wrap_policy": SPLITTING_POLICY}),
         ("fsdp", {"auto_wrap_policy": SPLITTING_POLICY, "reshard_after_forward": False})]
TIED = {"pair": ("emb.weight", "head.weight"), "lm": ("tok_embedding.weight", "head.weight")}


def build(kind: str, seed: int = 0) -> nn.Module:
    with SEED_LOCK:  # in-memory ranks are threads sharing torch's generator
        torch.manual_seed(seed)
        return MODELS[kind]().double()


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def rank_slice(batch, rank: int, world: int):
    per = BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def reference_run(kind: str, steps: int = STEPS):
    """Single-process Adam on whole batches: the state dict after every step."""
    model = build(kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    history = []
    for x, y in batches(steps):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        history.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return history


def train(backend, kind, strategy, settings, steps=STEPS, first_step=0, load_from=None, save_to=None):
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build(kind, seed=0 if load_from is None else 99), backend, **settings)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    loaded = None
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
        loaded = model.gather_full_parameters()
    history = []
    for batch in batches(first_step + steps)[first_step:]:
        model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        history.append(model.gather_full_parameters())
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=first_step + steps)
    return loaded, history


def assert_states_equal(actual, expected, atol):
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy, settings", CASES)
def test_tied_training_equals_one_process(kind, world, strategy, settings):
    reference = reference_run(kind)
    for _, history in spawn(lambda b: train(b, kind, strategy, settings), world, timeout=120):
        for step, expected in enumerate(reference):
            assert_states_equal(history[step], expected, atol=1e-10)  # both tied names present


def _units_and_traffic(backend, kind, strategy, settings):
    model_cls, opt_cls = STRATEGIES[strategy]
    module = build(kind)
    model = model_cls(module, backend, **settings)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    model.train_step(rank_slice(batches(1)[0], backend.rank, backend.world_size), loss_fn, opt)
    backend.stats.reset()
    model.train_step(rank_slice(batches(1)[0], backend.rank, backend.world_size), loss_fn, opt)
    return module, model, backend.stats.snapshot()["calls"]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("strategy, settings", CASES[:3])
def test_tied_weight_is_stored_and_reduced_once(kind, strategy, settings):
    for module, model, calls in spawn(lambda b: _units_and_traffic(b, kind, strategy, settings), 2):
        tied = module.get_parameter(TIED[kind][0])
        assert module.get_parameter(TIED[kind][1]) is tied
        holders = [u for u in model.units for p in u.params if p is tied]
        assert len(holders) == 1 and holders[0].module is module   # their common ancestor's unit
        assert [e.name for e in holders[0].space.entries if e.param is tied] == [TIED[kind][0]]
        # One flat space entry per distinct parameter: the unique storages hold each element once.
        assert sum(u.space.numel for u in model.units) == sum(p.numel() for p in module.parameters())
        masters = {u.master.untyped_storage().data_ptr() for u in model.units}
        assert len(masters) == len(model.units)
        # The masters, and the NaNs of the resharded units, one per parameter (sharded_unit.py).
        nans = sum(8 * len(u.params) for u in model.units if not u.is_unsharded)
        assert model.memory_footprint()["parameters"] == sum(u.master.nbytes for u in model.units) + nans
        assert calls["reduce_scatter"] == len(model.units)   # one per unit, the tied one once


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoint_moves_between_zero3_and_ddp(tmp_path, kind):
    """zero3 (world 2) -> ddp (world 3) -> zero3 (world 2): every load is bit-exact and the
    whole run still equals one process."""
    reference = reference_run(kind, 6)
    chain = [("zero3", 2), ("ddp", 3), ("zero3", 2)]
    previous, last = None, None
    for k, (strategy, world) in enumerate(chain):
        target = tmp_path / f"step-{k}"
        results = spawn(lambda b: train(b, kind, strategy, {}, steps=2, first_step=2 * k,
                                        load_from=previous, save_to=target), world, timeout=120)
        for loaded, history in results:
            if last is not None:
                assert_states_equal(loaded, last, atol=0)
            assert_states_equal(history[-1], reference[2 * k + 1], atol=1e-10)
        last = results[0][1][-1]
        saved = read_metadata(target)["parameters"]
        assert TIED[kind][1] not in saved, "a tied weight is saved once, under its first name"
        stored = checkpoint.consolidate(target)
        # ... and consolidated as the unwrapped model's state_dict() has it: under both names.
        assert stored[TIED[kind][1]] is stored[TIED[kind][0]]
        for name, value in stored.items():
            torch.testing.assert_close(value, last[name], rtol=0, atol=0)
        with SEED_LOCK:
            MODELS[kind]().double().load_state_dict(stored)  # strict: every key is there
        previous = target
