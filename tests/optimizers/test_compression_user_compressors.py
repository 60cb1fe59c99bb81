"""A user's own compressor, and copies of ours. One written to Horovod's signature (compress
without key=) failed with a TypeError inside backward, one returning a bare tensor as its payload
with a size error from the wire split; both are ConfigErrors saying what to write. A deepcopy of a
compressor in use was refused as "already serves rank 0": the copy carried the original's rank."""
import copy
import time

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.optimizers import GradientCompressionOptimizer
from distframe.optimizers.compression import Compressor, PowerSGDCompressor
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice


class WithoutKey(Compressor):
    def compress(self, tensor):
        return (tensor.to(torch.float16),), tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)


class BarePayload(Compressor):
    def compress(self, tensor, *, key=None):
        return tensor.to(torch.float16), tensor.dtype

    def decompress(self, payload, ctx):
        return payload.to(ctx)


def step(backend, compressor):
    model = STRATEGIES["ddp"][0](build_model(), backend)
    opt = GradientCompressionOptimizer(model, torch.optim.SGD, compressor=compressor, lr=0.1)
    model.train_step(rank_slice(global_batches(1, 4)[0], backend.rank, 2), loss_fn, opt)
    return True


@pytest.mark.parametrize("compressor,message", [
    (WithoutKey, "takes no key= argument; define it as compress"),
    (BarePayload, "payload a tuple of tensors"),
])
def test_user_compressors_off_the_contract_get_config_errors(compressor, message):
    with pytest.raises(ConfigError, match=message):
        spawn(lambda backend: step(backend, compressor()), 2)


def test_a_copy_of_a_compressor_in_use_serves_another_rank():
    shared = PowerSGDCompressor(rank=1, start_iter=0)

    def run(backend):
        model = STRATEGIES["ddp"][0](build_model(), backend)
        build = lambda compressor: GradientCompressionOptimizer(   # noqa: E731
            model, torch.optim.SGD, compressor=compressor, lr=0.1)
        if backend.rank == 0:
            opt = build(shared)
        else:  # a copy once rank 0 holds the original (construction is collective: no barrier)
            deadline = time.monotonic() + 30
            while "_holder" not in shared.__dict__:
                assert time.monotonic() < deadline, "rank 0 never claimed the compressor"
                time.sleep(0.001)
            opt = build(copy.deepcopy(shared))
        model.train_step(rank_slice(global_batches(1, 4)[0], backend.rank, 2), loss_fn, opt)
        return True

    assert all(spawn(run, 2))
