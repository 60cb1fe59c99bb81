"""NCCL engine: asking for more GPUs than are visible raises BackendUnavailableError naming the
fix, on any machine; with two GPUs, a short parity run over CPU (staged) and GPU tensors. The
conformance suite runs every collective on NCCL where GPUs are present (one rank per GPU, CPU and
GPU inputs). The engine shares all of its collective code with Gloo, which
test_gloo_collectives covers."""
from __future__ import annotations

import pytest
import torch

from distframe.backends import NCCLCommunicationBackend
from distframe.backends.torch_dist import from_environment, visible_gpus
from distframe.errors import BackendUnavailableError
from distframe.launch import init_backend, spawn

VISIBLE = visible_gpus()
enough_gpus = VISIBLE >= 2


class TestTooFewGPUs:
    """One rank more than there are GPUs (none on a CPU machine)."""

    def test_constructor_explains_what_is_missing(self):
        with pytest.raises(BackendUnavailableError, match="nccl.*GPU.*gloo"):
            NCCLCommunicationBackend(0, 2, torch.distributed.HashStore(), device=VISIBLE, timeout=5)

    def test_spawn_fails_before_starting_processes(self):
        with pytest.raises(BackendUnavailableError, match=f"needs {VISIBLE + 1} GPUs"):
            spawn(rank_sum, VISIBLE + 1, "nccl", timeout=5)

    def test_torchrun_environment(self, monkeypatch):
        for name, value in {"RANK": str(VISIBLE), "WORLD_SIZE": str(VISIBLE + 1),
                            "LOCAL_RANK": str(VISIBLE), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(BackendUnavailableError, match=f"needs {VISIBLE + 1} GPUs"):
            from_environment("nccl", timeout=5)
        with pytest.raises(BackendUnavailableError):
            init_backend("nccl", timeout=5)


def rank_sum(b):
    cpu = torch.full((3,), float(b.rank + 1))
    gpu = torch.full((3,), float(b.rank + 1), device=f"cuda:{b.rank}")
    b.all_reduce(cpu)
    b.all_reduce(gpu)
    gathered = b.all_gather(torch.tensor([b.rank]))
    flags = torch.tensor([b.rank == 0, True])
    b.all_reduce(flags, "product")
    return cpu, gpu.cpu(), gathered, flags


@pytest.mark.gpu
@pytest.mark.skipif(not enough_gpus, reason="needs 2 CUDA GPUs")
def test_nccl_collectives_on_cpu_and_gpu_tensors():
    for cpu, gpu, gathered, flags in spawn(rank_sum, 2, "nccl", timeout=60):
        assert cpu.device.type == "cpu" and cpu.tolist() == [3.0] * 3
        assert gpu.tolist() == [3.0] * 3
        assert gathered.device.type == "cpu" and gathered.tolist() == [0, 1]
        assert flags.tolist() == [False, True]


_ONE_RANK = """
import torch
from distframe.backends import NCCLCommunicationBackend
backend = NCCLCommunicationBackend(0, 1, torch.distributed.HashStore(), timeout=60)
group = backend.new_group([0])
print(backend.all_reduce(torch.ones(3, device="cuda")).sum().item(),
      group.all_reduce(torch.ones(2, device="cuda")).sum().item())
backend.shutdown()
"""


@pytest.mark.gpu
@pytest.mark.skipif(VISIBLE == 0, reason="needs a GPU")
def test_shutdown_ends_the_nccl_groups_as_destroy_process_group_does():
    # torch warns at exit about each NCCL group that was never shut down (leaked communicators).
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _ONE_RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3.0", "2.0"]
    assert "destroy_process_group" not in done.stderr, done.stderr
