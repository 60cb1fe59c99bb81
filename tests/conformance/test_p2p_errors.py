"""Point-to-point errors on the engines that check a receive's size without debug=True: in-memory
and MPI (checks in checks_p2p.py). Gloo raises CollectiveTimeoutError at its timeout instead
(tests/backends/test_gloo_sends.py), or CollectiveMismatchError at once with debug=True; NCCL
checks it only with debug=True."""
import pytest

from tests.conformance import checks_p2p
from tests.conformance.conftest import ENGINE_SPECS, _marks
from tests.conformance.engines import make_runner

SIZED = [s for s in ENGINE_SPECS if s.split("-")[0] in ("inmemory", "mpi")]


@pytest.fixture(scope="module", params=[pytest.param(s, marks=_marks(s)) for s in SIZED])
def sized_runner(request):
    r = make_runner(request.param)
    yield r
    r.close()


def test_a_mismatched_receive_raises_on_every_wait(sized_runner):
    sized_runner.run(checks_p2p.check_a_mismatched_receive_raises_on_every_wait)
