"""ZeRO-3 and FSDP under the forward and backward patterns users write around units: a unit run
several times in one forward (weights shared across layers), activation checkpointing around it,
and several backward passes over one forward. Each trains exactly like one process (float64)."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import FSDPModel
from distframe.optimizers import FSDPOptimizer
from tests.models.common import (HIDDEN, IN, OUT, SEED_LOCK, SETTINGS, STRATEGIES, Block, build_model,
                                 global_batches, loss_fn, rank_slice, reference_run)

STEPS, BATCH = 3, 12


class Universal(nn.Module):
    """One block applied three times (a universal transformer's weight sharing), each
    application optionally under activation checkpointing."""

    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(IN, HIDDEN), Block(HIDDEN), nn.Linear(HIDDEN, OUT)
        self.checkpointing = checkpointing

    def forward(self, x):
        x = self.inp(x)
        for _ in range(3):
            if self.checkpointing is None:
                x = self.block(x)
            else:
                x = checkpoint(self.block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.out(x)


def universal(checkpointing: str | None) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return Universal(checkpointing).double()


def single_process(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model`` trained on the whole batches with Adam: its state dict after the last step."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in global_batches(STEPS, BATCH):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def universal_reference(checkpointing: str | None) -> dict[str, torch.Tensor]:
    return single_process(universal(checkpointing))


CASES = [("zero3", {}), ("zero3", {"reshard_after_forward": False, "prefetch": False}),
         ("fsdp", {"auto_wrap_policy": lambda module, name: name in ("inp", "block", "out")})]


@pytest.mark.parametrize("strategy, settings", CASES)
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_a_unit_applied_several_times_per_forward(strategy, settings, checkpointing):
    # Reentrant checkpointing runs one backward per application, so the shared unit's gradients
    # are complete several times in one step: each must be reduced (only the first was; the
    # others stayed in the full-size .grad and were added to the next step's gradient).
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(universal(checkpointing), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(STEPS, BATCH):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        leftover = [n for n, p in model.wrapped_model.named_parameters() if p.grad is not None]
        return model.gather_full_parameters(), leftover
    expected = universal_reference(checkpointing)
    for params, leftover in spawn(run, 2, timeout=20):
        assert leftover == []
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_two_backward_passes_over_one_forward_add_up(strategy):
    # loss / 2 backpropagated twice (retain_graph) is loss backpropagated once; the second
    # backward's gradients were never reduced and leaked into the next step's.
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(STEPS, BATCH):
            x, y = rank_slice(batch, backend.rank, backend.world_size)
            loss = loss_fn(model(x), y)
            (loss / 2).backward(retain_graph=True)
            (loss / 2).backward()
            opt.step()
            opt.zero_grad()
        return model.gather_full_parameters()
    expected = reference_run(global_batches(STEPS, BATCH))[-1]
    for params in spawn(run, 2, timeout=20):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


@pytest.mark.parametrize("strategy, settings", CASES)
def test_a_checkpointed_unit_recomputed_whole_in_backward_stays_gathered(strategy, settings):
    # Without early stop, non-reentrant checkpointing recomputes the unit's whole forward after
    # its pre_backward gathered it; that forward's post_forward resharded it, and the backward
    # then read freed parameters ("setStorage: ... out of bounds for storage of size 0").
    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(universal("non-reentrant"), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        with set_checkpoint_early_stop(False):
            for batch in global_batches(STEPS, BATCH):
                model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()
    expected = universal_reference("non-reentrant")
    for params in spawn(run, 2, timeout=20):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


class Indexed(nn.Module):
    """Calls the children of its nn.Sequential one by one, so the Sequential's own forward never
    runs; ``tied``: two of those children share a weight (ZeRO-3 then makes a unit of the
    Sequential, their lowest common ancestor, for it)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(IN, HIDDEN), Block(HIDDEN), nn.Linear(HIDDEN, HIDDEN),
                                    nn.Linear(HIDDEN, OUT))
        if tied:
            self.layers[2].weight = self.layers[1].fc.weight

    def forward(self, x):
        for index in range(len(self.layers)):
            x = self.layers[index](x)
        return x


def indexed(tied: bool) -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return Indexed(tied).double()


KEPT_GATHERED = {"replicate_below_numel": 10**6}
NEVER_CALLED_CASES = [("zero3", {}), ("zero3", KEPT_GATHERED), ("fsdp", SETTINGS["fsdp"]),
                      ("fsdp", {**SETTINGS["fsdp"], **KEPT_GATHERED}),
                      ("fsdp", {**SETTINGS["fsdp"], "reshard_after_forward": False, "prefetch": False})]


@pytest.mark.parametrize("strategy, settings", NEVER_CALLED_CASES,
                         ids=["zero3", "zero3-kept", "fsdp", "fsdp-kept", "fsdp-no-reshard"])
def test_a_unit_whose_module_never_runs_is_refused_at_the_first_step(strategy, settings):
    # The unit of the Sequential was never gathered: freed, the forward crashed ("setStorage: ...
    # out of bounds for storage of size 0"); kept gathered, it trained silently on the values of
    # its first gather, never refreshed after a step (2e-2 off one process after a few steps).
    steps_done = []

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(indexed(tied=strategy == "zero3"), backend, **settings)
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(STEPS, BATCH):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
            steps_done.append(backend.rank)
    with pytest.raises(ConfigError, match=r"unit 'layers' \(Sequential\).*call 'layers' as a whole"):
        spawn(run, 2, timeout=20)
    assert steps_done == []


@pytest.mark.parametrize("tied", [False, True])
def test_units_of_the_children_that_run_train_exactly(tied):
    # The fix the error names for FSDP: a policy that wraps the Sequential's children instead.
    def run(backend):
        policy = lambda module, name: name.startswith("layers.")  # noqa: E731
        model = FSDPModel(indexed(tied), backend, auto_wrap_policy=policy)
        opt = FSDPOptimizer(model, torch.optim.Adam, lr=1e-2)
        for batch in global_batches(STEPS, BATCH):
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()
    reference = single_process(indexed(tied))
    for params in spawn(run, 2, timeout=20):
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)
