"""``distframe train`` on a GPU: NCCL ranks (one per GPU) train the model on CUDA with each
data-parallel strategy, the same loss curve as the CPU run on the in-memory engine (float64,
same seed), peak GPU memory in the metrics, and a checkpoint saved on the GPU resumes on the CPU.
Needs a CUDA device; skipped elsewhere."""
from __future__ import annotations

import pytest

from distframe.backends.torch_dist import visible_gpus
from tests.train.conftest import train

GPUS = visible_gpus()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]
FLAGS = ("--dtype", "float64", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3")


def assert_same_losses(gpu: list[dict], cpu: list[dict]) -> None:
    """Six steps each, with the CPU run's training and validation losses to 1e-8."""
    assert [m["step"] for m in gpu] == list(range(1, 7))
    for a, b in zip(cpu, gpu):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-8)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-8)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_nccl_training_equals_the_cpu_run(tmp_path, corpus_file, strategy):
    world = str(min(GPUS, 2))
    gpu = train(tmp_path / "gpu", corpus_file, "--backend", "nccl", "--world-size", world,
                "--strategy", strategy, *FLAGS)
    cpu = train(tmp_path / "cpu", corpus_file, "--backend", "inmemory", "--world-size", world,
                "--strategy", strategy, *FLAGS)
    assert_same_losses(gpu, cpu)
    assert all(m["peak_memory_bytes"] > 0 for m in gpu)
    # The GPU run's checkpoint continues on the CPU exactly like the CPU run.
    resumed = train(tmp_path / "gpu", corpus_file, "--backend", "inmemory", "--world-size", world,
                    "--strategy", strategy, *FLAGS[:2], "--steps", "9", "--eval-every", "3",
                    "--checkpoint-every", "3", "--resume")
    continued = train(tmp_path / "cpu", corpus_file, "--backend", "inmemory", "--world-size", world,
                      "--strategy", strategy, *FLAGS[:2], "--steps", "9", "--eval-every", "3",
                      "--checkpoint-every", "3", "--resume")
    assert [m["train_loss"] for m in resumed] == pytest.approx([m["train_loss"] for m in continued],
                                                               abs=1e-8)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_compiled_nccl_training_equals_the_eager_cpu_run(tmp_path, corpus_file, strategy):
    """``--compile`` (inductor: Triton kernels for each block) on NCCL ranks, one per GPU."""
    world = str(min(GPUS, 2))
    flags = ("--world-size", world, "--strategy", strategy, *FLAGS)
    gpu = train(tmp_path / "gpu", corpus_file, "--backend", "nccl", "--compile", *flags)
    cpu = train(tmp_path / "cpu", corpus_file, "--backend", "inmemory", *flags)
    assert_same_losses(gpu, cpu)
