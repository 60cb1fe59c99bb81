"""A plain torch optimizer over some of a model's trainable parameters (fine-tuning the norms; two
optimizers over disjoint parts, as a GAN's) saves and loads the state of those, and a resumed run
is the uninterrupted one; a checkpoint whose optimizer trained parameters the loading optimizer
does not hold is refused (their state would be dropped). State for a tensor outside the model
(a learnable loss temperature) is refused at save, before anything is written, and at a load
that would discard it; such a tensor without state (another stage's parameter, in an optimizer
built before the pipeline wrap) has nothing to lose and is no error."""
import pytest
import torch
from torch import nn

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import DDPModel
from distframe.models.pipeline import PipelineParallelModel
from tests.models.common import build_model, global_batches, loss_fn, rank_slice

ATOL = 1e-12  # float64; the resumed run does the uninterrupted one's arithmetic
BATCHES = global_batches(3, 4)


def _build(kind, backend, seed=0):
    """The model (DDP over 2 ranks, or 2 pipeline stages) and its parameters by dense name."""
    if kind == "ddp":
        model = DDPModel(build_model(seed=seed), backend)
        return model, dict(model.module.named_parameters())
    model = PipelineParallelModel(build_model(seed=seed), backend, num_microbatches=2)
    return model, dict(model.dense_named_parameters())


def _norms_only(named):
    return torch.optim.Adam([p for n, p in named.items() if ".norm." in n], lr=0.05)


def _step(kind, model, opt, batch):
    backend = model.backend
    local = rank_slice(batch, backend.rank, backend.world_size) if kind == "ddp" else batch
    model.train_step(local, loss_fn, opt)


def _assert_same(expected, got):
    for want, params in zip(expected, got):
        assert want.keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["ddp", "pp"])
def test_an_optimizer_over_the_norms_resumes_as_uninterrupted(tmp_path, kind):
    # Saving skipped the parameters the optimizer does not hold; loading refused them, on every
    # rank ("the optimizer does not optimise this model's local shards").
    def straight(backend):
        model, named = _build(kind, backend)
        opt = _norms_only(named)
        for batch in BATCHES:
            _step(kind, model, opt, batch)
        return model.gather_full_parameters()

    def first(backend):
        model, named = _build(kind, backend)
        opt = _norms_only(named)
        _step(kind, model, opt, BATCHES[0])
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)

    def resumed(backend):
        model, named = _build(kind, backend, seed=3)
        opt = _norms_only(named)
        checkpoint.load(tmp_path / "ckpt", model, opt)
        held = {n for n, p in named.items() if p in opt.state}
        for batch in BATCHES[1:]:
            _step(kind, model, opt, batch)
        return model.gather_full_parameters(), held

    expected = spawn(straight, 2, timeout=60)
    spawn(first, 2, timeout=60)
    got = spawn(resumed, 2, timeout=60)
    _assert_same(expected, [params for params, _ in got])
    for _, held in got:  # Adam's state came back for the norms (and only for them)
        assert held and all(".norm." in n for n in held), held


def _two_optimizers(named):
    """A GAN's pattern: one optimizer for the norms, another (other settings) for the rest."""
    norms = torch.optim.Adam([p for n, p in named.items() if ".norm." in n], lr=0.05)
    rest = torch.optim.Adam([p for n, p in named.items() if ".norm." not in n], lr=0.02)
    return norms, rest


def test_two_optimizers_over_disjoint_parts_resume_as_uninterrupted(tmp_path):
    def train(model, opts, batches):
        for batch in batches:
            for opt in opts:  # each steps its own part, on its own loss
                model.zero_grad()  # train_step's opt.zero_grad() clears its own part only
                _step("ddp", model, opt, batch)

    def straight(backend):
        model, named = _build("ddp", backend)
        train(model, _two_optimizers(named), BATCHES)
        return model.gather_full_parameters()

    def first(backend):
        model, named = _build("ddp", backend)
        norms, rest = _two_optimizers(named)
        train(model, (norms, rest), BATCHES[:1])
        checkpoint.save(tmp_path / "norms", model, norms, step=1)
        checkpoint.save(tmp_path / "rest", model, rest, step=1)

    def resumed(backend):
        model, named = _build("ddp", backend, seed=3)
        norms, rest = _two_optimizers(named)
        checkpoint.load(tmp_path / "norms", model, norms)
        checkpoint.load(tmp_path / "rest", model, rest)
        train(model, (norms, rest), BATCHES[1:])
        return model.gather_full_parameters()

    expected = spawn(straight, 2, timeout=60)
    spawn(first, 2, timeout=60)
    _assert_same(expected, spawn(resumed, 2, timeout=60))

    def mixed_up(backend):
        # The norms' checkpoint into the other optimizer: the norms' Adam state would be
        # dropped (and the rest would start afresh), so it is refused.
        model, named = _build("ddp", backend)
        with pytest.raises(ConfigError, match=r"holds optimizer state for \['1\.norm\.bias'.*does not hold"):
            checkpoint.load(tmp_path / "norms", model, _two_optimizers(named)[1])
        # Into an optimizer over every parameter: the norms resume, the rest start fresh.
        every = torch.optim.Adam(list(named.values()), lr=0.05)
        checkpoint.load(tmp_path / "norms", model, every)
        return sorted(n for n, p in named.items() if every.state.get(p))
    for held in spawn(mixed_up, 2, timeout=60):
        assert held == sorted(n for n in dict(build_model().named_parameters()) if ".norm." in n)


def _with_temperature(kind, backend):
    """A CLIP-style learnable loss temperature beside the model's parameters in one Adam."""
    model, named = _build(kind, backend)
    temperature = nn.Parameter(torch.ones((), dtype=torch.float64))
    opt = torch.optim.Adam(list(named.values()) + [temperature], lr=0.05)
    return model, opt, temperature


def _scaled_step(kind, model, opt, temperature, batch):
    backend = model.backend
    local = rank_slice(batch, backend.rank, backend.world_size) if kind == "ddp" else batch
    model.train_step(local, lambda out, target: loss_fn(out * temperature, target), opt)


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.parametrize("kind", ["ddp", "pp"])
def test_state_of_a_tensor_outside_the_model_is_refused(tmp_path, kind):
    # The temperature's Adam state was left out of the checkpoint without a word: the resumed
    # run started it afresh and its temperature differed by 1.26e-2.
    path = tmp_path / "ckpt"

    def run(backend):
        model, opt, temperature = _with_temperature(kind, backend)
        checkpoint.save(path, model, opt, step=0)  # before any step it has no state to lose
        before = _files(path)
        _scaled_step(kind, model, opt, temperature, BATCHES[0])
        with pytest.raises(ConfigError, match=r"state for 1 tensor.*shape \(\).*cannot save it.*"
                                              r"register each on the model as an nn\.Parameter"):
            checkpoint.save(path, model, opt, step=1)
        backend.barrier()  # every rank has looked at the refused save's outcome
        assert _files(path) == before  # the previous checkpoint is untouched
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # and nothing else written
        held = {k: v.clone() for k, v in opt.state.get(temperature, {}).items()}
        with pytest.raises(ConfigError, match=r"state for 1 tensor.*shape \(\).*loading would discard it"):
            checkpoint.load(path, model, opt)
        kept = opt.state.get(temperature, {})
        assert kept.keys() == held.keys() and all(torch.equal(kept[k], v) for k, v in held.items())
        # A fresh optimizer, whose temperature has no state yet, loads the step-0 checkpoint.
        fresh, fresh_opt, _ = _with_temperature(kind, backend)
        checkpoint.load(path, fresh, fresh_opt)
        return bool(held)
    had_state = spawn(run, 2, timeout=60)
    # The temperature trains where the loss is: on every rank under DDP, on the last stage only.
    assert had_state == ([True, True] if kind == "ddp" else [False, True])


def test_an_optimizer_built_before_a_pipeline_wrap_resumes_as_uninterrupted(tmp_path):
    # It holds the other stage's parameters too, which never get state here: nothing to refuse.
    def build(backend, seed=0):
        dense = build_model(seed=seed)
        opt = torch.optim.Adam(dense.parameters(), lr=0.05)
        return PipelineParallelModel(dense, backend, num_microbatches=2), opt

    def straight(backend):
        model, opt = build(backend)
        for batch in BATCHES:
            _step("pp", model, opt, batch)
        return model.gather_full_parameters()

    def first(backend):
        model, opt = build(backend)
        _step("pp", model, opt, BATCHES[0])
        checkpoint.save(tmp_path / "ckpt", model, opt, step=1)

    def resumed(backend):
        model, opt = build(backend, seed=3)
        checkpoint.load(tmp_path / "ckpt", model, opt)
        for batch in BATCHES[1:]:
            _step("pp", model, opt, batch)
        return model.gather_full_parameters()

    expected = spawn(straight, 2, timeout=60)
    spawn(first, 2, timeout=60)
    _assert_same(expected, spawn(resumed, 2, timeout=60))
