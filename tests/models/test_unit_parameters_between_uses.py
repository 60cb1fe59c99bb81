"""ZeRO-3 and FSDP parameters outside forward and backward. Their gathered storage is freed
between uses; the parameters were views of it that kept their shape, and reading one (logging a
weight norm, an EMA of the weights, printing it) read freed memory and crashed the process. Now
each holds a stand-in of its shape that reads as NaN ([Note: parameters between uses] in
sharded_unit.py): the metadata user code relies on stays right, no read touches freed memory."""
import pytest
import torch

from distframe.launch import spawn
from tests.models.common import (SETTINGS, STRATEGIES, build_model, global_batches, loss_fn,
                                 rank_slice)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_parameters_read_between_uses_are_nan_of_their_own_shape(strategy):
    dense = {n: p.shape for n, p in build_model().named_parameters()}

    def run(backend):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.Adam, lr=1e-2)
        model.train_step(rank_slice(global_batches(1, 4)[0], backend.rank, backend.world_size), loss_fn, opt)
        params = dict(model.wrapped_model.named_parameters())
        shapes = {n: p.shape for n, p in params.items()}
        norms = [p.detach().norm().item() for p in params.values()]   # read freed memory before
        ema = {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in params.items()}
        for n, p in params.items():
            ema[n].lerp_(p.detach(), 0.1)
        with pytest.raises(RuntimeError), torch.no_grad():
            next(iter(params.values())).add_(1.0)   # no write lands in a stand-in
        repr(next(iter(params.values())))
        out = model(global_batches(1, 4)[0][0])     # and the next forward gathers them again
        return shapes, norms, ema, out, model.gather_full_parameters()

    for shapes, norms, ema, out, full in spawn(run, 2):
        assert shapes == dense
        assert all(n != n for n in norms)   # NaN: no values between uses (gather_full_parameters has them)
        assert all(torch.isnan(e).all() for e in ema.values())
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(t).all() for t in full.values())
