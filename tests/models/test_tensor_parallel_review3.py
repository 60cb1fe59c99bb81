"""Tensor-parallel plans the review found silently wrong, each against the dense model on one
process (float64, 1e-10):

* a replicated value used inside the split region (nn.PReLU's weight between a 'column' and a
  'row' sibling, a replicated gate): each rank saw its slice and got a partial gradient;
* a planned Linear whose parent reads ``.weight`` itself: nn.MultiheadAttention's out_proj
  (refused), nn.TransformerEncoderLayer's fused inference path (kept off it);
* a user's own torch.utils.checkpoint around a block with dropout (a new mask when recomputed);
* a Linear registered under two names (``self.alias = self.up``).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from attention.recompute import same_dropout_masks
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import TensorParallelModel
from distframe.models.tensor_parallel_rng import TensorParallelRNG, derive_seed, replace_dropouts
from tests.models.common import SEED_LOCK

ATOL = 1e-10


def build(cls, *args):
    with SEED_LOCK:
        torch.manual_seed(0)
        return cls(*args).double()


def assert_one_step_matches(init, plan, x, y, loss_fn=F.mse_loss, world=2):
    """One SGD step under tensor parallelism gives the dense step's loss and parameters on every
    rank, and the ranks' replicated parameters agree bitwise."""
    dense = copy.deepcopy(init)
    loss = loss_fn(dense(x), y)
    loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()

    def run(backend):
        model = TensorParallelModel(copy.deepcopy(init), backend, plan=plan)
        got = model.train_step((x, y), loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
        replicated = {lp.name: lp.param.detach().clone() for lp in model.local_parameters
                      if lp.split_dim is None}
        return got, model.gather_full_parameters(), replicated

    results = spawn(run, world)
    for got, full, _ in results:
        assert abs(got - loss.item()) < ATOL
        for name, value in dense.named_parameters():
            torch.testing.assert_close(full[name], value.detach(), rtol=0, atol=ATOL, msg=name)
    for name, value in results[0][2].items():
        assert all(torch.equal(other[2][name], value) for other in results[1:]), name


# ---- 1. replicated values inside the split region ------------------------------------------------
class PReLUMlp(nn.Module):
    def __init__(self, shared_act: bool = False) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.PReLU(), nn.Linear(8, 4)
        self.shared_act = shared_act

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(x)))
        return self.act(y) if self.shared_act else y  # the same weight outside the region too


class GatedMlp(nn.Module):
    """A replicated activation (a per-token gate) multiplies the split hidden features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.gate, self.fc2 = nn.Linear(4, 8), nn.Linear(4, 1), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * torch.sigmoid(self.gate(x)))


@pytest.mark.parametrize("init", [lambda: build(PReLUMlp), lambda: build(PReLUMlp, True),
                                  lambda: build(GatedMlp)], ids=["prelu", "prelu-also-outside", "gate"])
def test_a_replicated_value_inside_the_split_region_gets_the_whole_gradient(init):
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    assert_one_step_matches(init(), {"fc1": "column", "fc2": "row"}, x, y)


# ---- 2. parents that read a planned Linear's weight themselves ----------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.mlp(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("style", ["row", "column"])
def test_a_multihead_attention_projection_in_the_plan_is_refused(style):
    plan = {"attn.out_proj": style, "mlp.0": "column", "mlp.2": "row"}
    with pytest.raises(ConfigError, match=r"'attn.out_proj'.*'attn' is an nn.MultiheadAttention.*"
                                          r"MultiheadDilatedAttention"):
        spawn(lambda backend: TensorParallelModel(build(Attention), backend, plan=plan), 2, timeout=30)


def encoder_layer():
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


def test_an_encoder_layer_in_eval_without_grad_computes_the_dense_output():
    init = build(encoder_layer).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = init(x)  # torch's fused inference path

    def run(backend):
        plan = {"linear1": "column", "linear2": "row"}
        model = TensorParallelModel(copy.deepcopy(init), backend, plan=plan)
        model.eval()
        with_grad = model(x).detach()  # (the first forward with grad runs the plan's checks)
        with torch.no_grad():
            return with_grad, model(x)

    for with_grad, got in spawn(run, 2):
        torch.testing.assert_close(with_grad, expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_an_encoders_validation_loss_is_the_dense_one():
    init = build(lambda: nn.Sequential(nn.TransformerEncoder(encoder_layer(), 2, enable_nested_tensor=True),
                                       nn.Flatten(), nn.Linear(40, 3))).eval()
    x = torch.randn(4, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        expected = F.cross_entropy(init(x), y).item()
    plan = {f"0.layers.{i}.{name}": style for i in range(2)
            for name, style in (("linear1", "column"), ("linear2", "row"))}

    def run(backend):
        model = TensorParallelModel(copy.deepcopy(init), backend, plan=plan)
        model.eval()
        return model.validation_loss(x, y, F.cross_entropy).item()

    for got in spawn(run, 2):
        assert abs(got - expected) < ATOL


# ---- 3. a user's torch.utils.checkpoint around dropout -------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(self.mlp(x))


class Net(nn.Module):
    def __init__(self, context: bool | None) -> None:
        super().__init__()
        self.context = context  # None: no checkpoint; False: checkpoint alone; True: with context_fn
        self.b1, self.b2, self.out = Block(), Block(), nn.Linear(8, 3)

    def forward(self, x):
        for block in (self.b1, self.b2):
            if self.context is None:
                x = block(x)
            elif self.context:
                x = checkpoint(block, x, use_reentrant=False,
                               context_fn=lambda b=block, d=x.device: same_dropout_masks(b, d))
            else:
                x = checkpoint(block, x, use_reentrant=False)
        return self.out(x)


CHECKPOINT_PLAN = {f"{b}.mlp.{i}": s for b in ("b1", "b2") for i, s in (("0", "column"), ("2", "row"))}
SEED = 7


def checkpoint_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def test_a_checkpointed_block_with_dropout_and_same_dropout_masks_is_exact():
    x, y = checkpoint_batch()
    init = build(Net, True)
    dense = copy.deepcopy(init)
    dense.context = None
    # The masks tensor rank 0 of a tp=2 group draws: the generator seeded as its replicated one.
    replace_dropouts(dense, TensorParallelRNG(derive_seed(SEED, "replicated", 0, 0), 0))
    loss = F.cross_entropy(dense(x), y)
    loss.backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()

    def run(backend):
        model = TensorParallelModel(copy.deepcopy(init), backend, plan=CHECKPOINT_PLAN, dropout_seed=SEED)
        got = model.train_step((x, y), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
        return got, model.gather_full_parameters()

    for got, full in spawn(run, 2):
        assert abs(got - loss.item()) < ATOL
        for name, value in dense.named_parameters():
            torch.testing.assert_close(full[name], value.detach(), rtol=0, atol=ATOL, msg=name)


def test_a_checkpointed_block_whose_dropout_draws_a_new_mask_is_a_config_error():
    x, y = checkpoint_batch()

    def run(backend):
        model = TensorParallelModel(build(Net, False), backend, plan=CHECKPOINT_PLAN, dropout_seed=SEED)
        with pytest.raises(ConfigError, match=r"'b2.drop'.*recomput.*context_fn=.*same_dropout_masks"):
            model.train_step((x, y), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
        return True

    assert spawn(run, 2) == [True, True]


# ---- 4. a Linear registered under two names ----------------------------------------------------
class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.alias = self.up
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.alias(x)))


@pytest.mark.parametrize("plan", [{"up": "column", "down": "row"}, {"alias": "column", "down": "row"},
                                  {"up": "column", "alias": "column", "down": "row"}],
                         ids=["by-name", "by-alias", "both"])
def test_a_module_under_two_names_is_split_under_both(plan):
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    assert_one_step_matches(build(Twice), plan, x, y)

    def run(backend):
        model = TensorParallelModel(build(Twice), backend, plan=plan).wrapped_model
        return model.alias is model.up and type(model.up).__name__ == "ColumnParallelLinear"

    assert spawn(run, 2) == [True, True]


def test_one_module_planned_two_ways_under_its_two_names_is_a_config_error():
    plan = {"up": "column", "alias": "row", "down": "row"}
    with pytest.raises(ConfigError, match=r"'up' and 'alias' name one module"):
        spawn(lambda backend: TensorParallelModel(build(Twice), backend, plan=plan), 2, timeout=30)
