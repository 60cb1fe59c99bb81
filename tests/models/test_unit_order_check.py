"""ZeRO-3/FSDP units whose modules run in a rank-dependent order: with units of one size every
all_gather pairs shards of two units without an error of the engine's, and the model trained on
parameters mixed across ranks. The order is compared after the first forward with grad (and after
each one on a backend in debug mode): a ConfigError names the units and the ranks."""
import pytest
import torch
from torch import nn

from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES

SETTINGS = {"zero3": {}, "fsdp": {"auto_wrap_policy": lambda module, name: name in ("a", "b")}}


class TwoOfOneSize(nn.Module):
    """``a`` then ``b``, or ``b`` then ``a`` on ranks in ``swapped_ranks`` from ``swap_from_step``."""

    def __init__(self, rank: int, swapped_ranks: tuple[int, ...], swap_from_step: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.swapped = rank in swapped_ranks
        self.swap_from_step, self.step = swap_from_step, 0

    def forward(self, x):
        self.step += 1
        if self.swapped and self.step > self.swap_from_step:
            return self.a(torch.tanh(self.b(x)))
        return self.b(torch.tanh(self.a(x)))


def train(backend, strategy, swapped_ranks, swap_from_step=0, steps=2, **settings):
    """``steps`` train_steps of SGD on a batch of ones."""
    with SEED_LOCK:
        torch.manual_seed(0)
        module = TwoOfOneSize(backend.rank, swapped_ranks, swap_from_step).double()
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(module, backend, **SETTINGS[strategy], **settings)
    opt = opt_cls(model, torch.optim.SGD, lr=0.1)
    x = torch.ones(4, 8, dtype=torch.float64)
    for _ in range(steps):
        model.train_step((x, torch.zeros(4, 8, dtype=torch.float64)), nn.functional.mse_loss, opt)
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_units_of_one_size_run_in_another_order_on_one_rank(strategy):
    # Trained without an error: every all_gather of the forward joined a's shard on some ranks
    # with b's on the others.
    with pytest.raises(ConfigError, match=r"ranks 0, 2 ran 'a', 'b'; rank 1 ran 'b', 'a'"):
        spawn(lambda backend: train(backend, strategy, swapped_ranks=(1,)), 3, timeout=30)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_an_order_that_changes_after_the_first_step_is_found_in_debug_mode(strategy):
    # Only the first forward is compared by default; a backend in debug mode compares each one.
    # Without prefetch (which follows the previous step's order, so its gathers would differ in
    # number and the engine's check would fail first) the forward's gathers paired a with b.
    def run(backend):
        return train(backend, strategy, swapped_ranks=(0,), swap_from_step=1, steps=3, prefetch=False)
    with pytest.raises(ConfigError, match=r"rank 0 ran 'b', 'a'; rank 1 ran 'a', 'b'"):
        spawn(run, 2, timeout=30, debug=True)
