"""ZeRO-3/FSDP under a MixedPrecisionPolicy go on training after a summon_full_parameters() block.

Inside the block the parameters' ``.data`` hold the masters' dtype, and torch gives a parameter a
new gradient accumulator when ``.data`` changes dtype. The check of whether a backward pass
accumulates (PassAccumulation, [Note: a pass that only reads gradients]) held the accumulators of
construction, which never ran again: every later pass counted as one that accumulates nothing,
no gradient was reduced, and the parameters stopped moving, silently. Each step after a block now
equals the same run without the block (float64 masters, float32 compute: exact, both round alike).
"""
import copy

import pytest
import torch

from distframe import spawn
from distframe.precision import MixedPrecisionPolicy
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice

SETTINGS = {"zero3": {}, "fsdp": {"auto_wrap_min_params": 100}}


@pytest.mark.parametrize("writeback", [True, False])
@pytest.mark.parametrize("strategy", sorted(SETTINGS))
def test_steps_after_a_summon_equal_steps_without_it(strategy, writeback):
    def run(backend, summon):
        model_cls, opt_cls = STRATEGIES[strategy]
        model = model_cls(copy.deepcopy(build_model()), backend,
                          mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32), **SETTINGS[strategy])
        opt = opt_cls(model, torch.optim.SGD, lr=0.1)
        history = []
        for step, batch in enumerate(global_batches(4, 8)):
            if summon and step == 1:
                with model.summon_full_parameters(writeback=writeback):
                    pass
            model.train_step(rank_slice(batch, backend.rank, 2), loss_fn, opt)
            history.append(model.gather_full_parameters())
        return history

    with_block = spawn(lambda b: run(b, True), 2, timeout=30)
    without = spawn(lambda b: run(b, False), 2, timeout=30)
    for got, want in zip(with_block, without):
        for step, (params, reference) in enumerate(zip(got, want)):
            for name, value in reference.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=f"step {step}: {name}")
        assert not torch.equal(got[-1]["0.weight"], got[1]["0.weight"])  # it trains after the block
