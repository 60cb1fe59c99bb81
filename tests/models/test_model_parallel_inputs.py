"""Models that take more than one input under tensor parallelism and hybrid data parallelism
(no pipeline): ``train_step`` unpacks a tuple or dict of inputs into the call as every other
strategy does (``ShardedModelBase.forward_backward``), and gives what one process gives."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distframe.launch import spawn
from distframe.mesh import ParallelDims
from distframe.models.hybrid import HybridShardedModel
from distframe.models.tensor_parallel_model import TensorParallelModel
from tests.models.common import SEED_LOCK


class MaskedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, mask):
        return self.fc_out(torch.tanh(self.fc_in(x))) * mask


def _data():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    return x, (torch.rand(4, 3, generator=g) > 0.3).double(), y


WRAPS = {
    "tensor": lambda m, b: TensorParallelModel(m, b, plan={"fc_in": "column", "fc_out": "row"}),
    "hybrid-dp": lambda m, b: HybridShardedModel(m, b, dims=ParallelDims(dp=2)),
}


@pytest.mark.parametrize("packing", ["tuple", "dict"])
@pytest.mark.parametrize("strategy", list(WRAPS))
def test_several_inputs_are_unpacked_into_the_call(strategy, packing):
    with SEED_LOCK:
        torch.manual_seed(0)
        template = MaskedMLP().double()
    x, mask, y = _data()
    reference = copy.deepcopy(template)
    expected_loss = F.mse_loss(reference(x, mask), y)
    expected_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    def worker(backend):
        model = WRAPS[strategy](copy.deepcopy(template), backend)
        share = slice(None) if strategy == "tensor" else slice(2 * backend.rank, 2 * backend.rank + 2)
        inputs = (x[share], mask[share]) if packing == "tuple" else {"x": x[share], "mask": mask[share]}
        loss = model.train_step((inputs, y[share]), F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        with torch.no_grad():
            validation = model.validation_loss(inputs, y[share], F.mse_loss)
        return loss, share, float(validation), model.gather_full_parameters()

    for loss, share, validation, params in spawn(worker, 2):
        assert loss == pytest.approx(float(expected_loss.detach()), rel=1e-12)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-12, atol=1e-12)
        with torch.no_grad():
            expected = F.mse_loss(reference(x[share], mask[share]), y[share])
        assert validation == pytest.approx(float(expected), rel=1e-12)
