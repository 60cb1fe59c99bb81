"""One parity run per strategy on the process engines (Gloo and MPI, world 2), each engine's
worker processes started once for the module."""
import pytest
import torch

from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice, reference_run

STEPS = 3
ENGINES = [pytest.param("gloo", marks=pytest.mark.gloo), pytest.param("mpi", marks=pytest.mark.mpi)]


@pytest.fixture(scope="module", params=ENGINES)
def pool(request):
    if request.param == "gloo":
        from distframe._process_launch import ProcessPool
        pool = ProcessPool(2, "gloo", timeout=60)
    else:
        from distframe._mpi_launch import MPIPool
        pool = MPIPool(2, timeout=60)
    yield pool
    pool.close()


def train(backend, strategy):
    """Default settings (few buckets and units: process engines pay per collective)."""
    model_cls, opt_cls = STRATEGIES[strategy]
    model = model_cls(build_model(), backend, auto_wrap_min_params=300)
    opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
    losses = [model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)
              for batch in global_batches(STEPS, 12)]
    return model.gather_full_parameters(), losses


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_parity_on_process_engines(pool, strategy):
    results = pool.run(train, strategy)
    expected = reference_run(global_batches(STEPS, 12))[-1]
    for params, losses in results:
        assert losses == results[0][1]
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10)


def test_find_unused_parameters_on_process_engines(pool):
    # The flags' all_reduce (uint8 MAX, asynchronous, behind the buckets) on each engine.
    from tests.models.test_unused_parameters import assert_matches, batches, reference, run_ddp
    data = batches(3, 12)
    assert_matches(pool.run(run_ddp, data), reference(data, 2))


@pytest.mark.parametrize("strategy", ["zero3", "fsdp-per-layer"])
def test_a_parameter_some_ranks_leave_unused_on_process_engines(pool, strategy):
    # Rank 1 gives `gated.extra` no gradient: its units must still reduce where rank 0's do.
    from tests.models.test_unused_parameters import batches
    from tests.models.test_unused_parameters_sharded import assert_matches_without_spare, train_gated
    data = batches(3, 12)
    assert_matches_without_spare(pool.run(train_gated, strategy, data), data)


class Boom(Exception):
    pass


def _raise_boom(grad):
    raise Boom("raised in backward on purpose")


def rank_raises_in_a_sharded_backward(backend):
    """Rank 1 raises in backward (a hook on an activation); rank 0's prefetched all_gather is
    queued behind the reduce_scatter its peer never joins."""
    from distframe.models import ZeRO3Model
    from distframe.optimizers import ZeRO3Optimizer
    model = ZeRO3Model(build_model(), backend)
    opt = ZeRO3Optimizer(model, torch.optim.Adam, lr=1e-2)

    def raise_on_rank_1(module, inputs, output):
        if backend.rank == 1:
            output.register_hook(_raise_boom)
    model.wrapped_model[1].register_forward_hook(raise_on_rank_1)
    batch = global_batches(1, 12)[0]
    model.train_step(rank_slice(batch, backend.rank, backend.world_size), loss_fn, opt)


def test_a_rank_that_raises_in_a_sharded_backward_is_the_error_reported(pool):
    # Last in the module: the pool restarts its workers after a failed run. Before, rank 0's
    # follow-on error (a plain DistFrameError: "all_gather ... was not run: reduce_scatter ...
    # failed (RankFailedError ...)") was re-raised, and Boom's text reached the caller nowhere.
    with pytest.raises(Boom, match="on purpose") as info:
        pool.run(rank_raises_in_a_sharded_backward)
    assert any("raised on rank 1" in note for note in info.value.__notes__)
