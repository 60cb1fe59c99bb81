import pytest

from tests.conformance.engines import make_runner

# Every engine and world size the conformance suite runs on (issue 2): in-memory 1-4,
# Gloo (spawned processes) 2 and 3, MPI (mpiexec) 2 and 3.
ENGINE_SPECS = ["inmemory-1", "inmemory-2", "inmemory-3", "inmemory-4",
                "gloo-2", "gloo-3", "mpi-2", "mpi-3"]


def _marks(spec: str):
    engine = spec.split("-")[0]
    return [getattr(pytest.mark, engine)] if engine in ("gloo", "mpi") else []


@pytest.fixture(scope="module", params=[pytest.param(s, marks=_marks(s)) for s in ENGINE_SPECS])
def runner(request):
    r = make_runner(request.param)
    yield r
    r.close()
