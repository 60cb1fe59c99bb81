"""summon_full_parameters(): every parameter whole inside a with block, as FSDP1's
summon_full_params. ZeRO-3/FSDP parameters hold NaN stand-ins between uses, so before it there
was no way to read or edit the weights in place (an EMA, a re-initialisation, an evaluation of
edited weights); these tests check the values inside against gather_full_parameters(), that
edits carry into training exactly as in one process (writeback) or are dropped, and that
leaving communicates nothing."""
import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import MixedPrecisionPolicy, TensorParallelModel
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice, tiny_lm)

CASES = {**{name: (name, SETTINGS[name]) for name in STRATEGIES},
         # units below 100 elements (the LayerNorms) stay gathered between steps
         "zero3-persistent": ("zero3", {"replicate_below_numel": 100})}


def wrap(case, backend, module=None, **extra):
    strategy, settings = CASES[case]
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model() if module is None else module, backend, **settings, **extra)
    return model, opt_cls(model, torch.optim.Adam, lr=1e-2)


def halve(module):
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)


def reference_halved_between_steps(batches):
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(batches):
        if step == 1:
            halve(model)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_inside_is_gathered_and_written_edits_train_as_one_process(case, world):
    batches = global_batches(2, 6)

    def run(backend):
        model, opt = wrap(case, backend)
        model.train_step(rank_slice(batches[0], backend.rank, world), loss_fn, opt)
        with torch.no_grad():
            model(batches[0][0])   # gathers the units after the step: nothing is stale on entering
        before = model.gather_full_parameters()
        with model.summon_full_parameters():
            inside = {n: p.detach().clone() for n, p in model.wrapped_model.named_parameters()}
            halve(model.wrapped_model)
            calls = dict(backend.stats.calls)
        left = dict(backend.stats.calls)
        after_exit_nan = [bool(torch.isnan(p).all()) for p in model.wrapped_model.parameters()]
        model.train_step(rank_slice(batches[1], backend.rank, world), loss_fn, opt)
        return before, inside, calls, left, after_exit_nan, model.gather_full_parameters()

    expected = reference_halved_between_steps(batches)
    for before, inside, calls, left, after_exit_nan, final in spawn(run, world):
        assert inside.keys() == {n for n in before}
        for name, value in inside.items():
            assert torch.equal(value, before[name]), name
        assert calls == left   # leaving is local: nothing for a rank to wait on
        sharded = CASES[case][0] in ("zero3", "fsdp") and case != "zero3-persistent"
        assert all(after_exit_nan) == sharded   # ZeRO-3/FSDP: back to their stand-ins
        for name, value in expected.items():
            torch.testing.assert_close(final[name], value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_without_writeback_edits_are_dropped(case):
    def run(backend):
        model, opt = wrap(case, backend)
        model.train_step(rank_slice(global_batches(1, 4)[0], backend.rank, 2), loss_fn, opt)
        before = model.gather_full_parameters()
        with model.summon_full_parameters(writeback=False):
            halve(model.wrapped_model)
        return before, model.gather_full_parameters(), model(global_batches(1, 4)[0][0])

    for before, after, out in spawn(run, 2):
        for name in before:
            assert torch.equal(before[name], after[name]), name
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp"])
def test_mixed_precision_summons_the_float32_masters(strategy):
    """Inside, parameters are the float32 masters, not their bfloat16 compute copies: an edit
    finer than bfloat16 resolves is kept whole."""
    def run(backend):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        model, opt = wrap(strategy, backend, build_model(torch.float32), mixed_precision=policy)
        x, y = (t.to(torch.bfloat16) for t in rank_slice(global_batches(1, 4)[0], backend.rank, 2))
        model.train_step((x, y), loss_fn, opt)
        before = model.gather_full_parameters()
        with model.summon_full_parameters():
            dtypes = {p.dtype for p in model.wrapped_model.parameters()}
            inside = {n: p.detach().clone() for n, p in model.wrapped_model.named_parameters()}
            with torch.no_grad():
                for p in model.wrapped_model.parameters():
                    p.add_(1e-5)
        after = model.gather_full_parameters()
        model.train_step((x, y), loss_fn, opt)   # the compute copies were refreshed: it trains on
        return dtypes, before, inside, after, model.gather_full_parameters()

    for dtypes, before, inside, after, trained in spawn(run, 2):
        assert dtypes == {torch.float32}
        for name in before:
            assert torch.equal(inside[name], before[name]), name
            torch.testing.assert_close(after[name], before[name] + 1e-5, rtol=0, atol=1e-7)
            assert torch.isfinite(trained[name]).all()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_tied_weights_are_one_tensor_inside(strategy):
    def run(backend):
        model_cls, _ = STRATEGIES[strategy]
        model = model_cls(tiny_lm(), backend)
        full = model.gather_full_parameters()
        with model.summon_full_parameters():
            lm = model.wrapped_model
            state = {n: t.detach().clone() for n, t in lm.state_dict().items()}
            tied = lm.head.weight is lm.tok_embedding.weight
        return full, state, tied

    for full, state, tied in spawn(run, 2):
        assert tied
        assert state.keys() == full.keys()
        for name in full:
            assert torch.equal(state[name], full[name]), name


@pytest.mark.parametrize("case", ["ddp", "zero2", "zero3", "fsdp"])
def test_misuse_is_refused_and_an_error_inside_restores_the_model(case):
    def run(backend):
        model, opt = wrap(case, backend)
        x, y = rank_slice(global_batches(1, 4)[0], backend.rank, 2)
        before = model.gather_full_parameters()
        errors = []
        with model.summon_full_parameters():
            for attempt in (lambda: model(x), lambda: model.summon_full_parameters().__enter__()):
                with pytest.raises(ConfigError, match="summon_full_parameters") as info:
                    attempt()
                errors.append(str(info.value))
        with pytest.raises(KeyError), model.summon_full_parameters():
            halve(model.wrapped_model)
            raise KeyError("user code failed inside")
        loss = model.train_step((x, y), loss_fn, opt)   # the failed block left nothing behind
        return errors, before, loss

    results = spawn(run, 2)
    for errors, before, loss in results:
        assert "forward ran" in errors[0] and "entered again" in errors[1]
        assert loss == results[0][2]
    # The failed block's halving was not written back: the step began from `before`.
    reference = build_model()
    reference.load_state_dict(results[0][1])
    x, y = global_batches(1, 4)[0]
    assert results[0][2] == pytest.approx(loss_fn(reference(x), y).item(), rel=1e-12)


def test_model_parallel_models_refuse_it():
    def run(backend):
        dense = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        model = TensorParallelModel(dense, backend, plan={"0": "column", "2": "row"})
        with pytest.raises(ConfigError, match="gather_full_parameters"), model.summon_full_parameters():
            pass
        return True

    assert all(spawn(run, 2))


def replace_halved(module):
    for p in module.parameters():
        p.data = p.data * 0.5   # a new tensor, not an in-place write


@pytest.mark.parametrize("case", list(CASES))
def test_replaced_data_is_written_back(case):
    batches = global_batches(2, 6)

    def run(backend):
        model, opt = wrap(case, backend)
        model.train_step(rank_slice(batches[0], backend.rank, 2), loss_fn, opt)
        with model.summon_full_parameters():
            replace_halved(model.wrapped_model)
        model.train_step(rank_slice(batches[1], backend.rank, 2), loss_fn, opt)
        return model.gather_full_parameters()

    expected = reference_halved_between_steps(batches)
    for params in spawn(run, 2):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_units_kept_gathered_read_the_edit_right_after_the_block(strategy):
    def run(backend):
        model, _ = wrap(strategy, backend, replicate_below_numel=10 ** 9)   # every unit stays gathered
        with model.summon_full_parameters(), torch.no_grad():
            inside = [p.mul_(0.5).clone() for p in model.wrapped_model.parameters()]
        return inside, [p.detach().clone() for p in model.wrapped_model.parameters()]

    for inside, after in spawn(run, 2):
        for a, b in zip(inside, after):
            assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_between_forward_and_backward_reading_works_and_editing_is_refused(strategy):
    def run(backend):
        model, opt = wrap(strategy, backend)
        x, y = rank_slice(global_batches(1, 4)[0], backend.rank, 2)
        loss = loss_fn(model(x), y)
        with model.summon_full_parameters():   # reads only: nothing is written back
            norm = sum(float(p.detach().norm()) for p in model.wrapped_model.parameters())
        loss.backward()
        opt.step()
        with model.no_sync():   # a no_sync backward that ended: reading is fine after it
            loss_fn(model(x), y).backward()
        with model.summon_full_parameters():
            after_no_sync = sum(float(p.detach().norm()) for p in model.wrapped_model.parameters())
        loss_fn(model(x), y)
        with pytest.raises(ConfigError, match="whose step's backward has not ended"), \
                model.summon_full_parameters():   # an edit there would reach that backward
            halve(model.wrapped_model)
        return norm, after_no_sync

    for norm, after_no_sync in spawn(run, 2):
        assert norm == norm and after_no_sync == after_no_sync   # finite, not the NaN stand-ins
