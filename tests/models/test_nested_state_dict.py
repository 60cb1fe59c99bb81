"""A sharded model held by another module (a trainer, an nn.ModuleDict of student and teacher):
the enclosing module's state_dict() used to leave the sharded model out without a word, since its
state_dict() is this rank's share and ignored the destination and prefix it was handed."""
import pytest
from torch import nn

from distframe import spawn
from distframe.errors import ConfigError
from tests.models.common import SETTINGS, STRATEGIES, build_model


class Trainer(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.student = model
        self.head = nn.Linear(3, 1)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_enclosing_state_dict_refuses_rather_than_drops_the_sharded_model(strategy):
    def run(backend):
        model_cls, _ = STRATEGIES[strategy]
        model = model_cls(build_model(), backend, **SETTINGS[strategy])
        own = model.state_dict()  # called on the sharded model itself: its share, as before
        assert own and all("/" in key for key in own)
        with pytest.raises(ConfigError, match="'student'.*checkpoint.save"):
            Trainer(model).state_dict()
    spawn(run, 2, timeout=30)


def test_a_hybrid_model_held_by_another_module_is_refused_too():
    """HybridShardedModel writes its own state_dict(): it took the holder's prefix and dropped it."""
    from distframe.mesh import ParallelDims
    from distframe.models import HybridShardedModel

    def run(backend):
        model = HybridShardedModel(build_model(), backend, dims=ParallelDims(dp=2))
        assert all("/" in key for key in model.state_dict())
        with pytest.raises(ConfigError, match="'student'.*checkpoint.save"):
            Trainer(model).state_dict()
    spawn(run, 2, timeout=30)
