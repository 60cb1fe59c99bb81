"""HybridShardedModel: the dilated-attention LM trained under every (dp, tp, pp) layout up to 8
in-memory ranks equals single-process training (float64 1e-10); ZeRO-1/2 data parallelism;
sharded state that a DDPModel loads and back; one layout over Gloo processes."""
from __future__ import annotations

import copy

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.ddp import DDPModel
from distframe.models.hybrid import HybridShardedModel
from distframe.models.hybrid_factory import build_model_parallel
from distframe.models.pipeline import PipelineParallelModel
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import SEED_LOCK, lm_loss, tiny_lm

TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, BATCH, SEQ, LR = 2, 8, 16, 1e-2


def batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def reference_training(device="cpu"):
    """One process, whole batches, the model and batches on ``device``: losses and final state."""
    model = tiny_lm().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


_REFERENCE = None


def reference():
    global _REFERENCE
    if _REFERENCE is None:
        _REFERENCE = reference_training()
    return _REFERENCE


def dp_slice(batch, index, dp):
    x, y = batch
    per = x.shape[0] // dp
    return x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]


def train(backend, dims, data_parallel="ddp", schedule="1f1b"):
    model = HybridShardedModel(tiny_lm(), backend, dims=dims, num_microbatches=2, schedule=schedule,
                               data_parallel=data_parallel)
    if data_parallel == "ddp":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    else:
        from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer
        cls = ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer
        opt = cls(model, torch.optim.Adam, lr=LR)
    losses = [model.train_step(dp_slice(b, model.groups.dp_index, dims.dp), lm_loss, opt) for b in batches()]
    return losses, model.gather_full_parameters(), model.memory_footprint()


def check(results):
    losses, params = reference()
    for rank_losses, full, _ in results:
        assert rank_losses == pytest.approx(losses, rel=1e-12)
        assert full.keys() == params.keys()
        for name, tensor in params.items():
            torch.testing.assert_close(full[name], tensor, **TOL, msg=name)


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_layout_trains_like_one_process(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    check(spawn(lambda b: train(b, dims), dims.world_size))


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (2, 1, 2)])
def test_zero_data_parallel(dp, tp, pp, data_parallel):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    results = spawn(lambda b: train(b, dims, data_parallel, "gpipe"), dims.world_size)
    check(results)
    ddp = spawn(lambda b: train(b, dims), dims.world_size)
    # ZeRO keeps 1/dp of the optimizer state of a ddp hybrid rank (up to padding).
    for (_, _, zero_mem), (_, _, ddp_mem) in zip(results, ddp):
        assert zero_mem["optimizer_state"] <= ddp_mem["optimizer_state"] / dp + 64


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_zero_moves_two_thirds_of_an_all_reduce_and_gather(data_parallel):
    """Over the data-parallel group a step reduce-scatters the flat gradients and all-gathers the
    updated chunks: 2(dp-1)/dp of the parameters on the wire, where all-reducing the gradients
    first would make it 3(dp-1)/dp. The only all_reduce left is the loss's."""
    from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2, pp=2), data_parallel=data_parallel)
        opt = (ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer)(model, torch.optim.Adam, lr=LR)
        group = model.groups.replicas
        group.stats.reset()
        model.train_step(dp_slice(batches()[0], model.groups.dp_index, 2), lm_loss, opt)
        return group.stats.snapshot()["bytes"], model.zero.padded * model.zero.master.element_size()

    for sent, flat_bytes in spawn(run, 4):
        assert sent.get("reduce_scatter") == flat_bytes
        assert sent.get("all_gather") == flat_bytes // 2
        assert sent.get("all_reduce", 0) <= 8, sent  # the loss (a float64 scalar), never gradients


def test_tensor_parallel_splits_planned_layers_of_every_stage():
    # The plan's embedding and head are children of the model itself, which pipelining puts on
    # different stages: each stage must still split the planned layers it holds.
    config = tiny_lm().config

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(tp=2, pp=2), num_microbatches=2)
        return {lp.name: (lp.split_dim, tuple(lp.param.shape)) for lp in model.local_parameters}

    for params in spawn(run, 4):  # the tied embedding / head weight is on both stages
        assert params["tok_embedding.weight"] == (0, (config.vocab_size // 2, config.embed_dim))
        assert all(split == 0 for name, (split, _) in params.items() if name.endswith("fc_in.weight"))


def _partly_frozen_mlp():
    with SEED_LOCK:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                    torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)  # with pp=2 split at 2: a first stage with nothing to train
    return model


@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("pp", [1, 2])
def test_frozen_parameters_stay_frozen(data_parallel, pp, tmp_path):
    # torch.optim skips a parameter whose .grad is None: averaging the gradients over dp must not
    # hand frozen ones a zero gradient, which weight decay (or ZeRO's master chunk) would apply;
    # and they have no optimizer state for a checkpoint to save or load.
    from distframe import checkpoint
    from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    dense = _partly_frozen_mlp()
    opt = torch.optim.SGD(dense.parameters(), **kw)
    for _ in range(2):
        torch.nn.functional.mse_loss(dense(x), y).backward()
        opt.step()
        opt.zero_grad()

    def run(b, step):  # the first step, then a checkpoint; a fresh model loads it for the second
        model = HybridShardedModel(_partly_frozen_mlp(), b, dims=ParallelDims(dp=2, pp=pp),
                                   num_microbatches=2, data_parallel=data_parallel,
                                   split_points=[2] if pp > 1 else None)
        opt = (torch.optim.SGD(model.parameters(), **kw) if data_parallel == "ddp" else
               (ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer)(model, torch.optim.SGD, **kw))
        if step == 1:
            checkpoint.load(tmp_path, model, opt)
        model.train_step(dp_slice((x, y), model.groups.dp_index, 2), torch.nn.functional.mse_loss, opt)
        if step == 0:
            checkpoint.save(tmp_path, model, opt, step=1)
        return model.gather_full_parameters()

    spawn(lambda b: run(b, 0), 2 * pp)
    for full in spawn(lambda b: run(b, 1), 2 * pp):
        for name, tensor in dense.state_dict().items():
            torch.testing.assert_close(full[name], tensor, **TOL, msg=name)


@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("pp, via", [(1, "forward_backward"), (1, "backward"), (2, "forward_backward")])
def test_backwards_synchronised_in_turn_accumulate_like_one_process(data_parallel, pp, via):
    # Two backwards, each followed by synchronize_gradients, then one step (no no_sync): as with
    # torch DDP the averages add up. ZeRO re-sent or dropped the first average, and a second
    # model(x) did not re-arm synchronize_gradients (it communicated once per forward_backward).
    from distframe.optimizers import ZeRO1Optimizer, ZeRO2Optimizer

    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(2, 8, 5, generator=g, dtype=torch.float64), torch.randn(2, 8, 3, generator=g,
                                                                                 dtype=torch.float64)

    def half_mse(output, target):
        return torch.nn.functional.mse_loss(output, target) / 2
    dense = _partly_frozen_mlp().requires_grad_(True)
    opt = torch.optim.Adam(dense.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        half_mse(dense(x), y).backward()
    opt.step()

    def run(b):
        model = HybridShardedModel(_partly_frozen_mlp().requires_grad_(True), b, num_microbatches=2,
                                   dims=ParallelDims(dp=2, pp=pp), data_parallel=data_parallel,
                                   split_points=[2] if pp > 1 else None)
        zero = ZeRO1Optimizer if data_parallel == "zero1" else ZeRO2Optimizer
        opt = (torch.optim.Adam(model.parameters(), lr=0.1) if data_parallel == "ddp" else
               zero(model, torch.optim.Adam, lr=0.1))
        for x, y in zip(xs, ys):
            x, y = dp_slice((x, y), model.groups.dp_index, 2)
            if via == "backward":
                half_mse(model(x), y).backward()
            else:
                model.forward_backward((x, y), half_mse)
            model.synchronize_gradients()
        opt.step()
        return model.gather_full_parameters()

    for full in spawn(run, 2 * pp):
        for name, tensor in dense.state_dict().items():
            torch.testing.assert_close(full[name], tensor, **TOL, msg=name)


def test_zero_needs_its_optimizer():
    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2), data_parallel="zero1")
        model.train_step(batches()[0], lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(ConfigError, match="ZeRO1Optimizer"):
        spawn(run, 2)


def _merged_state(results):
    merged = {}
    for state in results:
        overlap = merged.keys() & state.keys()
        assert not overlap, f"two ranks wrote {sorted(overlap)[:3]}"
        merged.update(state)
    return merged


def test_state_dict_loads_under_ddp_and_back():
    trained = tiny_lm()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    expected = trained.state_dict()
    dims = ParallelDims(dp=2, tp=2, pp=2)

    def save_hybrid(b):
        return HybridShardedModel(copy.deepcopy(trained), b, dims=dims, num_microbatches=2).state_dict()

    hybrid_state = _merged_state(spawn(save_hybrid, 8))

    def load_ddp(b):
        model = DDPModel(tiny_lm(), b)
        model.load_state_dict(hybrid_state)
        return model.gather_full_parameters(), model.state_dict()

    ddp_results = spawn(load_ddp, 2)
    for full, _ in ddp_results:
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=0)
    ddp_state = _merged_state([state for _, state in ddp_results])

    def load_hybrid(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(tp=2, pp=2), num_microbatches=2)
        model.load_state_dict(ddp_state)
        return model.gather_full_parameters()

    for full in spawn(load_hybrid, 4):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=0)


def test_checkpoint_saved_under_hybrid_loads_under_ddp_and_back(tmp_path):
    """The on-disk round trip (distframe.checkpoint): hybrid (2,2,2) at world 8 -> DDP at world 3
    -> hybrid (1,2,2) at world 4, each bit-exact, with the dense names in the metadata."""
    from distframe import checkpoint

    trained = tiny_lm()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    expected = trained.state_dict()

    def save_hybrid(b):
        model = HybridShardedModel(copy.deepcopy(trained), b, dims=ParallelDims(dp=2, tp=2, pp=2),
                                   num_microbatches=2)
        checkpoint.save(tmp_path / "hybrid", model, step=3)

    def load_ddp(b):
        model = DDPModel(tiny_lm(), b)
        checkpoint.load(tmp_path / "hybrid", model)
        checkpoint.save(tmp_path / "ddp", model, step=4)
        return model.gather_full_parameters()

    def load_hybrid(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(tp=2, pp=2), num_microbatches=2)
        checkpoint.load(tmp_path / "ddp", model)
        return model.gather_full_parameters()

    spawn(save_hybrid, 8)
    assert set(checkpoint.consolidate(tmp_path / "hybrid")) >= {n for n, _ in trained.named_parameters()}
    for full in spawn(load_ddp, 3) + spawn(load_hybrid, 4):
        for name, tensor in expected.items():
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=0, msg=name)


def test_validation_loss_and_metadata_are_the_dense_models():
    lm = tiny_lm()
    x, y = batches()[0]
    expected = float(lm_loss(lm(x), y).detach())
    shapes = {n: list(p.shape) for n, p in lm.named_parameters()}

    def run(b):
        model = HybridShardedModel(tiny_lm(), b, dims=ParallelDims(dp=2, tp=2, pp=2), num_microbatches=2)
        dp, index = model.data_parallel_coordinates()
        assert (dp, index) == (2, model.groups.dp_index)
        meta = model.parameter_metadata()
        assert {n: m["shape"] for n, m in meta.items()} == shapes
        return float(model.validation_loss(x, y, lm_loss))

    assert spawn(run, 8) == pytest.approx([expected] * 8, rel=1e-12)


def test_factory_picks_the_model_class():
    def run(b, strategy, **kw):
        return type(build_model_parallel(strategy, tiny_lm(), b, micro_batches=2, **kw)).__name__

    assert spawn(lambda b: run(b, "pipeline"), 2)[0] == PipelineParallelModel.__name__
    assert spawn(lambda b: run(b, "tensor"), 2)[0] == TensorParallelModel.__name__
    assert spawn(lambda b: run(b, "hybrid", tp=2), 4)[0] == HybridShardedModel.__name__
    assert spawn(lambda b: run(b, "hybrid", cp=2), 4)[0] == HybridShardedModel.__name__
    with pytest.raises(ConfigError, match="strategy hybrid"):
        spawn(lambda b: run(b, "pipeline", cp=2), 4)
    with pytest.raises(ConfigError, match="product is 4"):
        spawn(lambda b: run(b, "hybrid", dp=1, tp=2, pp=1), 4)
    with pytest.raises(ConfigError, match="--tp 1 x --pp 1 x --cp 3 = 3 does not divide the world size 2"):
        spawn(lambda b: run(b, "hybrid", cp=3), 2)
    with pytest.raises(ConfigError, match="strategy"):
        spawn(lambda b: run(b, "diagonal"), 1)
    # A degree of 0 was taken for "not given" and inferred (tp=0 ran with tp=2).
    for bad in ({"tp": 0}, {"dp": 0}, {"pp": -1}, {"tp": 2.0}, {"cp": True}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))}=.*positive int"):
            spawn(lambda b, bad=bad: run(b, "tensor" if "tp" in bad else "hybrid", **bad), 2)


# ---- Gloo: one pool of 4 processes serves one test per model kind ------------------------------------
def _gloo_train(backend, kind):
    if kind == "hybrid":
        return train(backend, ParallelDims(tp=2, pp=2))
    if kind == "context":
        return train(backend, ParallelDims(pp=2, cp=2))
    if kind == "tensor-context":
        return train(backend, ParallelDims(tp=2, cp=2))
    model = (PipelineParallelModel(tiny_lm(), backend, num_microbatches=2) if kind == "pipeline"
             else TensorParallelModel(tiny_lm(), backend))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = [model.train_step(b, lm_loss, opt) for b in batches()]
    return losses, model.gather_full_parameters(), model.memory_footprint()


@pytest.fixture(scope="module")
def gloo_pool():
    from distframe._process_launch import ProcessPool

    with ProcessPool(4, "gloo", timeout=60) as pool:
        yield pool


@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["pipeline", "tensor", "hybrid", "context", "tensor-context"])
def test_model_parallel_on_gloo(gloo_pool, kind):
    check(gloo_pool.run(_gloo_train, kind))
