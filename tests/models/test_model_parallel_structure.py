"""Model-parallel wrapping of user models that computed another function, or drifted, without a
word: a module listed twice in an nn.Sequential (the pipeline ran it once), an nn.Sequential or LM
subclass with a forward of its own (the pipeline ran its layers in order), a tied weight split
along different dims on two stages, parameters frozen or unfrozen after wrapping a hybrid model,
a column paired with a row across a layer with weights, and context parallelism over a model that
cannot learn where its slice starts."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention.model import DilatedTransformerLM
from attention.multihead import MultiheadDilatedAttention
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from distframe.models.tensor_parallel_plan import default_tp_plan
from tests.models.common import SEED_LOCK, tiny_lm


def seeded(build):
    with SEED_LOCK:
        torch.manual_seed(0)
        return build().double()


class Residual(nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


TINY = tiny_lm().config


class ScaledLM(DilatedTransformerLM):
    def embed(self, tokens):
        return 4 * super().embed(tokens)


@pytest.mark.parametrize("build,message", [
    (lambda: (lambda shared: nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2)))(nn.Linear(4, 4)),
     "is the same module as layer '0'"),
    (lambda: Residual(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), "overrides Sequential's forward"),
    (lambda: ScaledLM(TINY), "overrides DilatedTransformerLM's forward"),
])
def test_pipelines_refuse_what_their_stages_would_not_compute(build, message):
    def run(backend):
        with pytest.raises(ConfigError, match=message):
            PipelineParallelModel(seeded(build), backend, num_microbatches=1)
        return True

    assert all(spawn(run, 2))


def test_a_tied_weight_split_two_ways_is_refused_across_stages():
    plan = {**default_tp_plan(tiny_lm()), "head": "row"}

    def run(backend):
        with pytest.raises(ConfigError, match="split along different dims"):
            HybridShardedModel(tiny_lm(), backend, dims=ParallelDims(tp=2, pp=2), tp_plan=plan)
        return True

    assert all(spawn(run, 4))


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_freezing_after_wrapping_a_hybrid_model_is_refused(data_parallel):
    def run(backend):
        model = HybridShardedModel(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))), backend,
                                   dims=ParallelDims(dp=2, pp=2), data_parallel=data_parallel)
        for p in model.parameters():
            p.requires_grad_(False)
        with pytest.raises(ConfigError, match="now has requires_grad=False"):
            model.forward_backward((torch.randn(4, 4, dtype=torch.float64),
                                    torch.randn(4, 2, dtype=torch.float64)), F.mse_loss)
        return True

    assert all(spawn(run, 4))


def test_a_column_and_a_row_with_weights_between_them_do_not_pair():
    def build():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4, dtype=torch.float64)
    expected = seeded(build)(x)

    def run(backend):
        model = TensorParallelModel(seeded(build), backend, plan={"0": "column", "4": "row"})
        return model(x)

    for out in spawn(run, 2):
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


class OwnPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(32, 16), nn.Embedding(16, 16)
        self.attn = MultiheadDilatedAttention(16, 4, segment_lengths=(4, 8), dilation_rates=(1, 2))

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.attn(h, h, h, is_causal=True)[0]


def test_context_parallelism_warns_when_no_module_can_learn_its_slice():
    # Caught here, around both rank threads: warning filters are process-wide, and two threads
    # each entering pytest.warns raced on them.
    with pytest.warns(RuntimeWarning, match="no module of the model has a sequence_shard") as caught:
        spawn(lambda backend: HybridShardedModel(seeded(OwnPositions), backend, dims=ParallelDims(cp=2)), 2)
    assert sum("sequence_shard" in str(w.message) for w in caught) == 2   # one per rank


@pytest.mark.parametrize("change", ["replace", "double"])
@pytest.mark.parametrize("dims", [ParallelDims(dp=2, pp=2), ParallelDims(tp=2, dp=2)])
def test_a_parameter_replaced_or_converted_after_wrapping_a_hybrid_model_is_refused(dims, change):
    # The data-parallel strategies refuse both (WrappedParameters); the hybrid model checked
    # requires_grad only: a replaced weight was never trained, a converted model failed in torch.
    def run(backend):
        model = HybridShardedModel(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))),
                                   backend, dims=dims, tp_plan={"0": "column", "1": "row"} if dims.tp > 1 else None)
        if change == "replace":
            name = next(n for n, _ in model.wrapped_model.named_parameters() if n.endswith("bias"))
            owner = model.wrapped_model.get_submodule(name.rpartition(".")[0])
            owner.bias = nn.Parameter(torch.zeros_like(owner.bias))
            pattern = r"'\d\.bias' was replaced after HybridShardedModel wrapped"
        else:
            model.wrapped_model.float()
            pattern = r"'\d\.weight' is torch\.float32, but HybridShardedModel holds it in torch\.float64"
        with pytest.raises(ConfigError, match=pattern):
            model.forward_backward((torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)),
                                   F.mse_loss)
        return True

    assert all(spawn(run, 4))
