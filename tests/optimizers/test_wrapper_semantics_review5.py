"""What a sharded optimizer keeps of torch.optim's semantics, review 5 (in-memory ranks, float64,
each against a plain torch optimizer in one process on the global batch). Before:
- ``zero_grad(set_to_none=False)`` set the flat shards' gradients to None under ZeRO-1/2/3 and
  FSDP, so a step after it (momentum, weight decay) was silently skipped (0.08 off);
- a param group dict, or the param_groups list, taken from an optimizer instance before it was
  handed over was disconnected: setting its ``lr`` mid-run changed nothing;
- a tensor setting (``Adam(lr=torch.tensor(0.01))``, tensor betas) came back from
  ``state_dict()``/``load_state_dict()`` and a checkpoint as a Python float (betas as a list of
  floats), so the resumed run drifted from the uninterrupted one (7e-10 after three steps)."""
import copy
import functools

import pytest
import torch

from distframe import checkpoint
from distframe.launch import spawn
from tests.models.common import SETTINGS, STRATEGIES, build_model, global_batches, loss_fn, rank_slice

TOLERANCE = {"rtol": 0, "atol": 1e-10}


def _assert_matches(results, expected):
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, **TOLERANCE, msg=name)


def _two_groups(model):
    """The head (the last Linear) in a group of its own: a sharded optimizer cuts its shards into
    pieces, whose gradients are views of the shards' (param_groups.py)."""
    head = list(model[3].parameters())
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    return [{"params": head, "lr": 0.02}, {"params": rest}]


# ---- zero_grad(set_to_none=False) -----------------------------------------------------------------
def _clear_and_step(model, opt, backward):
    """Steps and clears as a user might, with kept zero gradients: a step with no backward since the
    clear, a clear between backward and step, a backward adding to kept zeros, two backwards."""
    backward(0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()                       # zeros: momentum and weight decay still move the parameters
    backward(1)
    opt.zero_grad(set_to_none=False)
    opt.step()                       # the gradient was cleared: zeros again
    backward(2)                      # adds to the kept zeros (ZeRO-1: they were its bucket's chunk)
    opt.step()
    model.zero_grad(set_to_none=False)
    backward(0)
    backward(1)                      # accumulates on the synchronised average
    opt.step()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)


@pytest.mark.parametrize("grouped", [False, True], ids=["one group", "two groups"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_zero_grad_set_to_none_false_keeps_zero_gradients_the_optimizer_steps(strategy, grouped):
    batches = global_batches(3, 12)
    make = (lambda m: _sgd(_two_groups(m))) if grouped else (lambda m: _sgd(m.parameters()))

    reference = build_model()
    ref_opt = make(reference)

    def ref_backward(i):
        loss_fn(reference(batches[i][0]), batches[i][1]).backward()
    _clear_and_step(reference, ref_opt, ref_backward)
    expected = {n: p.detach() for n, p in reference.named_parameters()}

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, make(model.wrapped_model))

        def backward(i):
            x, y = rank_slice(batches[i], backend.rank, backend.world_size)
            loss_fn(model(x), y).backward()
        _clear_and_step(model, opt, backward)
        return model.gather_full_parameters()

    _assert_matches(spawn(run, 2, timeout=120), expected)


# ---- param groups held from before the wrapping ---------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True], ids=["one group", "two groups"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_param_group_held_from_the_instance_sets_the_lr_that_trains(strategy, grouped):
    batches = global_batches(4, 12)

    def make(model):
        opt = torch.optim.AdamW(_two_groups(model) if grouped else model.parameters(), lr=0.01)
        # A scheduler on the instance too: its initial_lr stays on the groups the user holds.
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

    def train(step, groups, schedule):
        head = groups[0]
        for i, batch in enumerate(batches):
            step(batch)
            schedule.step()
            if i == 1:
                head["lr"] = 0.1     # by hand, through a dict held from before the wrapping

    reference = build_model()
    ref_opt, ref_schedule = make(reference)

    def ref_step(batch):
        loss_fn(reference(batch[0]), batch[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    train(ref_step, ref_opt.param_groups, ref_schedule)
    expected = {n: p.detach() for n, p in reference.named_parameters()}

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        instance, schedule = make(model.wrapped_model)
        groups, dicts = instance.param_groups, list(instance.param_groups)
        opt = opt_cls(model, instance)
        if opt.param_groups is not groups or any(a is not b for a, b in zip(opt.param_groups, dicts)):
            raise AssertionError("the instance's param_groups list or its dicts were replaced")
        train(lambda b: model.train_step(rank_slice(b, backend.rank, backend.world_size), loss_fn, opt),
              groups, schedule)
        return model.gather_full_parameters()

    _assert_matches(spawn(run, 2, timeout=120), expected)


# ---- tensor settings through state_dict and a checkpoint ------------------------------------------
def _adam(params, lr_dtype, lr=0.01):
    betas = (torch.tensor(0.9, dtype=lr_dtype), torch.tensor(0.999, dtype=lr_dtype))
    return torch.optim.Adam(params, lr=torch.tensor(lr, dtype=lr_dtype), betas=betas, foreach=False)


def _uninterrupted(batches, lr_dtype):
    model = build_model()
    opt = _adam(model.parameters(), lr_dtype)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_settings(opt, lr_dtype):
    """The group holds tensors again, bitwise the saved run's (float64 -> float32 exactly)."""
    group = opt.param_groups[0]
    lr, betas = group["lr"], group["betas"]
    if not (isinstance(lr, torch.Tensor) and lr.dtype == lr_dtype
            and torch.equal(lr, torch.tensor(0.01, dtype=lr_dtype))):
        raise AssertionError(f"lr came back as {lr!r}")
    if not (isinstance(betas, tuple)
            and all(isinstance(b, torch.Tensor) and b.dtype == lr_dtype for b in betas)
            and torch.equal(betas[1], torch.tensor(0.999, dtype=lr_dtype))):
        raise AssertionError(f"betas came back as {betas!r}")


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64], ids=["float32 lr", "float64 lr"])
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_tensor_settings_survive_a_state_dict_round_trip(strategy, lr_dtype):
    batches = global_batches(5, 12)
    expected = _uninterrupted(batches, lr_dtype)
    model_cls, opt_cls = STRATEGIES[strategy]

    def first(backend):
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, _adam(model.parameters(), lr_dtype))
        for batch in batches[:2]:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.state_dict(), opt.state_dict()

    saved = spawn(first, 2, timeout=120)
    model_state = {k: v for m, _ in saved for k, v in m.items()}
    opt_state = {"tensors": {}, "scalars": {}, "param_groups": saved[0][1]["param_groups"]}
    for _, o in saved:
        opt_state["tensors"].update(o["tensors"])
        opt_state["scalars"].update(o["scalars"])

    def second(backend):
        model = model_cls(build_model(seed=4), backend, **SETTINGS[strategy])
        opt = opt_cls(model, _adam(model.parameters(), lr_dtype, lr=0.5))  # the load sets 0.01
        model.load_state_dict(model_state)
        opt.load_state_dict(copy.deepcopy(opt_state))
        _check_settings(opt, lr_dtype)
        for batch in batches[2:]:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        return model.gather_full_parameters()

    _assert_matches(spawn(second, 2, timeout=120), expected)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_tensor_settings_survive_a_checkpoint(tmp_path, strategy):
    batches = global_batches(5, 12)
    expected = _uninterrupted(batches, torch.float32)
    model_cls, opt_cls = STRATEGIES[strategy]

    def run(backend, resume):
        model = model_cls(build_model(seed=4 if resume else 0), backend, **SETTINGS[strategy])
        opt = opt_cls(model, _adam(model.parameters(), torch.float32, lr=0.5 if resume else 0.01))
        if resume:
            checkpoint.load(tmp_path / "ckpt", model, opt)
            _check_settings(opt, torch.float32)
        for batch in batches[2:] if resume else batches[:2]:
            model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
        if not resume:
            checkpoint.save(tmp_path / "ckpt", model, opt, step=2)
        return model.gather_full_parameters()

    spawn(functools.partial(run, resume=False), 2, timeout=120)
    _assert_matches(spawn(functools.partial(run, resume=True), 3, timeout=120), expected)
