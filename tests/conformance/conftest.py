import pytest

from distframe.backends.torch_dist import visible_gpus
from tests.conformance.engines import make_runner

# Every engine and world size the conformance suite runs on (issue 2): in-memory 1-4,
# Gloo (spawned processes) 2 and 3, MPI (mpiexec) 2 and 3.
ENGINE_SPECS = ["inmemory-1", "inmemory-2", "inmemory-3", "inmemory-4",
                "gloo-2", "gloo-3", "mpi-2", "mpi-3"]
# Where CUDA GPUs are present: every engine again with GPU inputs (in-memory, Gloo and MPI
# ranks share GPU 0), and NCCL with one rank per GPU, on CPU inputs (staged) and GPU inputs.
GPUS = visible_gpus()
if GPUS:
    ENGINE_SPECS += ["inmemory-2-cuda", "gloo-2-cuda", "mpi-2-cuda"]
    ENGINE_SPECS += [f"nccl-{w}{device}" for w in range(1, min(GPUS, 3) + 1) for device in ("", "-cuda")]


def _marks(spec: str):
    engine = spec.split("-")[0]
    marks = [getattr(pytest.mark, engine)] if engine in ("gloo", "mpi") else []
    return marks + ([pytest.mark.gpu] if engine == "nccl" or spec.endswith("-cuda") else [])


@pytest.fixture(scope="module", params=[pytest.param(s, marks=_marks(s)) for s in ENGINE_SPECS])
def runner(request):
    r = make_runner(request.param)
    yield r
    r.close()
