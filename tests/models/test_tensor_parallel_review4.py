"""Tensor-parallel cases the fourth review found silently wrong or obscure, each refused with a
ConfigError that says what to change, or computed as the dense model does:

* a planned subclass of nn.Linear / nn.Embedding with its own forward or extra parameters,
  buffers or submodules (the split layer replaced it, dropping them);
* a parametrized layer (weight_norm): a misleading 'tied' error before;
* nn.Embedding(sparse=True) under 'vocab' (made dense, silently);
* ShardedLayerNorm of float16/bfloat16 features (statistics in half precision: inf in float16);
* vocab_parallel_cross_entropy differentiated twice (an obscure in-place error);
* a split parameter read by the forward outside its layer (``h @ self.emb.weight.t()``).
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import ShardedLayerNorm, TensorParallelModel, vocab_parallel_cross_entropy
from tests.models.common import SEED_LOCK

TOL = 1e-10


def build(make):
    with SEED_LOCK:
        torch.manual_seed(0)
        return make().double()


def _wrap(make, plan, backend):
    return TensorParallelModel(build(make), backend, plan=plan)


# ---- 1. subclasses of the planned layers ---------------------------------------------------------
class ScaledLinear(nn.Linear):
    """A learned output gain: an extra parameter and its own forward."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return super().forward(x) * self.gain


class ClampLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x).clamp(-0.1, 0.1)


class ScaledEmbedding(nn.Embedding):
    def forward(self, tokens):
        return super().forward(tokens) * self.embedding_dim ** 0.5


class BufferLinear(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("mask", torch.ones(self.out_features))


class AdapterLinear(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.adapter = nn.Linear(self.in_features, self.out_features, bias=False)


class InitLinear(nn.Linear):
    """Only its initialisation differs: the split layer computes what it computes."""

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.1)
        nn.init.zeros_(self.bias)


SUBCLASSES = [
    (lambda: nn.Sequential(ScaledLinear(8, 16), nn.GELU(), nn.Linear(16, 8)), {"0": "column", "2": "row"},
     "0", "ScaledLinear", "its own forward and its parameter 'gain'"),
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), ClampLinear(16, 8)), {"0": "column", "2": "row"},
     "2", "ClampLinear", "its own forward"),
    (lambda: nn.Sequential(ScaledEmbedding(8, 4)), {"0": "vocab"}, "0", "ScaledEmbedding", "its own forward"),
    (lambda: nn.Sequential(BufferLinear(8, 8)), {"0": "column"}, "0", "BufferLinear", "its buffer 'mask'"),
    (lambda: nn.Sequential(AdapterLinear(8, 8)), {"0": "row"}, "0", "AdapterLinear",
     "its submodule 'adapter'"),
]


@pytest.mark.parametrize("make,plan,name,cls,dropped", SUBCLASSES, ids=[case[3] for case in SUBCLASSES])
def test_a_planned_subclass_that_computes_more_is_refused(make, plan, name, cls, dropped):
    """The split layer replaced the subclass, dropping what it adds: ScaledLinear's output differed
    from the dense one by 0.84 and gather_full_parameters raised KeyError '0.gain'."""
    with pytest.raises(ConfigError, match=rf"plan\['{name}'\]: its class {cls} .*{dropped} would be dropped.*"
                                          r"Plan a plain nn\.(Linear|Embedding).*"
                                          r"or leave it out of the plan"):
        spawn(functools.partial(_wrap, make, plan), 2, timeout=20)


def test_a_subclass_that_only_changes_its_init_is_split():
    make = lambda: nn.Sequential(InitLinear(8, 16), nn.GELU(), nn.Linear(16, 8))  # noqa: E731
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dense = build(make)
    F.mse_loss(dense(x), y).backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    for full in spawn(functools.partial(_one_step, make, {"0": "column", "2": "row"}, x, y), 2):
        for name, param in dense.named_parameters():
            assert (full[name] - param.detach()).abs().max() < TOL, name


def _one_step(make, plan, x, y, backend):
    model = _wrap(make, plan, backend)
    model.train_step((x, y), F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    return model.gather_full_parameters()


# ---- 2. parametrizations, 3. sparse embeddings ----------------------------------------------------
def test_a_parametrized_layer_is_refused_with_how_to_remove_the_parametrization():
    """It was refused as 'tied' to '0.parametrizations.weight', a plan entry refused in turn."""
    make = lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.GELU(),  # noqa: E731
                                 nn.Linear(16, 8))
    with pytest.raises(ConfigError, match=r"plan\['0'\].*parametriz.*cannot be split.*"
                                          r"torch\.nn\.utils\.parametrize\.remove_parametrizations.*"
                                          r"or leave it out of the plan"):
        spawn(functools.partial(_wrap, make, {"0": "column", "2": "row"}), 2, timeout=20)


def test_a_sparse_embedding_is_refused():
    """Its gradient was made dense, silently: torch.optim.SparseAdam then failed."""
    make = lambda: nn.Sequential(nn.Embedding(8, 4, sparse=True), nn.Linear(4, 8))  # noqa: E731
    with pytest.raises(ConfigError, match=r"'0'.*sparse=True.*sparse=False"):
        spawn(functools.partial(_wrap, make, {"0": "vocab"}), 2, timeout=20)


# ---- 4. ShardedLayerNorm in half precision --------------------------------------------------------
def _sharded_norm(x, dtype, backend):
    with SEED_LOCK:
        torch.manual_seed(0)
        norm = nn.LayerNorm(x.shape[-1])
        nn.init.normal_(norm.weight, 1.0, 0.1)
    sharded = ShardedLayerNorm.from_dense(norm.to(dtype), backend)
    return sharded(x.to(dtype).chunk(backend.world_size, -1)[backend.rank]), norm


@pytest.mark.parametrize("dtype,offset", [(torch.float16, 300.0), (torch.float16, 30.0),
                                          (torch.bfloat16, 30.0)])
def test_sharded_layer_norm_of_half_features_computes_its_statistics_in_float32(dtype, offset):
    """In float16 the sum over 256 features near 300 overflowed 65504 (every output inf/NaN); near
    30 the error was 15 times nn.LayerNorm's. Now as nn.LayerNorm: float32 statistics, one rounding."""
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + offset
    results = spawn(functools.partial(_sharded_norm, x, dtype), 2, timeout=20)
    got = torch.cat([out for out, _ in results], -1)
    norm = results[0][1].to(dtype)
    want = F.layer_norm(x.to(dtype).float(), (512,), norm.weight.float(), norm.bias.float())
    assert got.dtype == dtype and got.isfinite().all()
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    assert ((got.float() - want).abs() <= ulp * want.abs().clamp(min=1)).all()


# ---- 5. the vocab-parallel loss differentiated twice ----------------------------------------------
def _loss_gradient_and_second_derivative(logits, targets, backend):
    local = logits.chunk(backend.world_size, -1)[backend.rank].clone().requires_grad_()
    (grad,) = torch.autograd.grad(vocab_parallel_cross_entropy(local, targets, backend), local,
                                  create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        torch.autograd.grad(grad.square().sum(), local)
    return grad.detach()


def test_vocab_parallel_cross_entropy_is_differentiable_once():
    """A second derivative (create_graph=True) raised 'modified by an inplace operation'; it would
    have been wrong without (the statistics' all-reduces are not differentiable): torch's
    'differentiate twice' error now, with the first derivative still right."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 8, (6,), generator=g)
    dense = logits.clone().requires_grad_()
    (want,) = torch.autograd.grad(F.cross_entropy(dense, targets), dense)
    grads = spawn(functools.partial(_loss_gradient_and_second_derivative, logits, targets), 2, timeout=20)
    assert (torch.cat(grads, -1) - want).abs().max() < TOL


def _gradient_penalty(x, weight, targets, backend):
    local = weight.chunk(backend.world_size, 0)[backend.rank].clone().requires_grad_()
    inputs = x.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(inputs @ local.t(), targets, backend)
    (grad,) = torch.autograd.grad(loss, inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.square().sum().backward()
    return True


def test_a_gradient_penalty_through_vocab_parallel_cross_entropy_is_refused():
    """With ``once_differentiable`` alone the loss's gradient came back a constant (the mean's
    gradient does not require grad): the head weight's gradient was 0.08 off, silently."""
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g)
    targets = torch.randint(0, 8, (6,), generator=g)
    penalty = functools.partial(_gradient_penalty, x, weight.double(), targets)
    assert spawn(penalty, 2, timeout=20) == [True, True]


# ---- 6. a split parameter read outside its layer --------------------------------------------------
class FunctionalTie(nn.Module):
    """GPT-style tie: the output projection reads the 'vocab' embedding's weight itself."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, tokens):
        return torch.tanh(self.mid(self.emb(tokens))) @ self.emb.weight.t()


class Reads(nn.Module):
    """An MLP whose forward also reads one of its planned layers' parameters itself."""

    def __init__(self, read):
        super().__init__()
        self.fc_in, self.fc_out, self.read = nn.Linear(4, 8), nn.Linear(8, 4), read

    def forward(self, x):
        return self.read(self, x, self.fc_out(torch.relu(self.fc_in(x))))


READS = [
    (FunctionalTie, {"emb": "vocab"}, torch.tensor([[1, 5, 7]]), "emb.weight", "t"),
    (functools.partial(Reads, lambda m, x, y: y + m.fc_in.bias.sum()), {"fc_in": "column", "fc_out": "row"},
     torch.randn(3, 4, dtype=torch.float64), "fc_in.bias", "sum"),
    (functools.partial(Reads, lambda m, x, y: y + x @ m.fc_out.weight.T[:4]), {"fc_out": "row"},
     torch.randn(3, 4, dtype=torch.float64), "fc_out.weight", "T"),
]


def _refused(make, plan, x, grad, backend):
    model = _wrap(make, plan, backend)
    with torch.set_grad_enabled(grad), pytest.raises(ConfigError) as error:
        model(x)
    return str(error.value)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("make,plan,x,param,op", READS, ids=[case[3] for case in READS])
def test_a_split_parameter_read_outside_its_layer_is_a_config_error(make, plan, x, param, op, grad):
    """The functional tie returned each rank's slice of the logits ((2, 3, 4) of (2, 3, 8)) and
    train_step failed on a target 'out of bounds'; a read of a split bias or weight computed with
    one rank's slice, silently."""
    for message in spawn(functools.partial(_refused, make, plan, x, grad), 2, timeout=20):
        assert f"'{param}'" in message and f"'{op}'" in message, message
        assert "the plan splits that parameter" in message and "planned 'column'" in message, message
        assert "or leave" in message and "out of the plan" in message, message


class MetadataReads(nn.Module):
    """Reads of a split weight's dtype and device (not its values) are the model's business."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight  # tied through a 'column' layer, as the LM's head

    def forward(self, tokens):
        hidden = self.emb(tokens).to(device=self.head.weight.device, dtype=self.emb.weight.dtype)
        return self.head(hidden)


def _logits(x, backend):
    model = _wrap(MetadataReads, {"emb": "vocab", "head": "column"}, backend)
    with torch.no_grad():
        return model(x)


def test_a_tie_through_a_column_layer_and_metadata_reads_are_no_false_alarm():
    x = torch.tensor([[1, 5, 7], [0, 2, 6]])
    want = build(MetadataReads)(x).detach()
    for got in spawn(functools.partial(_logits, x), 2, timeout=20):
        assert (got - want).abs().max() < TOL
