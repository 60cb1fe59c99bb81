"""Optimizer state that is neither per element nor a scalar (Adafactor's row and column variances
of a matrix) under DDPModel, whose optimizer sees whole parameters: it trained, but state_dict()
and checkpoint.save refused it as "cannot be sharded". It is now saved whole, by the rank owning
the parameter, and a resume at another world size continues as one process does."""
import pytest
import torch

from distframe import checkpoint
from distframe.errors import ConfigError
from distframe.launch import spawn
from tests.models.common import SEED_LOCK, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor")
BATCHES = global_batches(4, 12)


def reference():
    model = build_model()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    for x, y in BATCHES:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(backend, path, steps, load):
    model_cls, opt_cls = STRATEGIES["ddp"]
    model = model_cls(build_model(), backend)
    opt = opt_cls(model, torch.optim.Adafactor, lr=0.01)
    if load:
        checkpoint.load(path, model, opt)
    for batch in steps:
        model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
    return model, opt


def test_adafactor_under_ddp_resumes_at_another_world_size(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: checkpoint.save(path, *train(b, path, BATCHES[:2], load=False), step=2), 2)
    results = spawn(lambda b: train(b, path, BATCHES[2:], load=True)[0].gather_full_parameters(), 3)
    expected = reference()
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


def test_loading_it_under_another_optimizer_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    spawn(lambda b: checkpoint.save(path, *train(b, path, BATCHES[:1], load=False), step=1), 2)

    def load_under_zero2(backend):
        model_cls, opt_cls = STRATEGIES["zero2"]   # whose shards are flat chunks: no Adafactor
        model = model_cls(build_model(), backend)
        with pytest.raises(ConfigError, match="state of Adafactor, not of Adam"):
            checkpoint.load(path, model, opt_cls(model, torch.optim.Adam, lr=0.01))
        return True

    assert all(spawn(load_under_zero2, 2))


def test_a_matrix_of_one_row_keeps_its_shaped_state(tmp_path):
    """Adafactor's row variance of a (1, n) weight is (1, 1): one element, but not a scalar."""
    def build():
        with SEED_LOCK:  # in-memory ranks are threads sharing torch's generator
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(5, 1), torch.nn.Linear(1, 3)).double()

    def run(backend, load):
        model_cls, opt_cls = STRATEGIES["ddp"]
        model = model_cls(build(), backend)
        opt = opt_cls(model, torch.optim.Adafactor, lr=0.01)
        if load:
            checkpoint.load(tmp_path / "ckpt", model, opt)
        for batch in BATCHES[2:] if load else BATCHES[:2]:
            x, y = rank_slice(batch, backend.rank, backend.world_size)
            model.train_step((x[:, :5], y), loss_fn, opt)
        if not load:
            checkpoint.save(tmp_path / "ckpt", model, opt, step=2)
        return model.gather_full_parameters()

    spawn(lambda b: run(b, False), 2)
    resumed = spawn(lambda b: run(b, True), 3)[0]
    single = build()
    opt = torch.optim.Adafactor(single.parameters(), lr=0.01)
    for x, y in BATCHES:
        loss_fn(single(x[:, :5]), y).backward()
        opt.step()
        opt.zero_grad()
    for name, value in single.state_dict().items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-10, atol=1e-10, msg=name)
