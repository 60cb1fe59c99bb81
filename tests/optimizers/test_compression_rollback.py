"""A checkpoint loaded into a GradientCompressionOptimizer that has trained since (a rollback)
replaces all of its state: the run then equals the uninterrupted one. PowerSGD kept the warm-start
factors of the abandoned steps when the checkpoint held none (saved before start_iter), and the
step count stayed where it was when the checkpoint held none (saved by DDPOptimizer)."""
import torch

from distframe import checkpoint
from distframe.launch import spawn
from distframe.optimizers import DDPOptimizer, GradientCompressionOptimizer
from distframe.optimizers.compression import PowerSGDCompressor
from tests.models.common import STRATEGIES, build_model, global_batches, loss_fn, rank_slice

BATCHES = global_batches(6, 8)


def build(backend, compressed=True):
    model = STRATEGIES["ddp"][0](build_model(), backend, bucket_cap_mb=0.001)
    if not compressed:
        return model, DDPOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    return model, GradientCompressionOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9,
                                               compressor=PowerSGDCompressor(rank=2, start_iter=3))


def train(model, opt, steps):
    for batch in steps:
        model.train_step(rank_slice(batch, model.backend.rank, model.backend.world_size), loss_fn, opt)


def test_rollback_before_start_iter_equals_the_uninterrupted_run(tmp_path):
    def run(backend):
        model, opt = build(backend)
        train(model, opt, BATCHES[:2])
        checkpoint.save(tmp_path / "ckpt", model, opt, step=2)
        train(model, opt, BATCHES[2:])
        straight = model.gather_full_parameters()
        checkpoint.load(tmp_path / "ckpt", model, opt)   # the same objects, 4 steps later
        train(model, opt, BATCHES[2:])
        return straight, model.gather_full_parameters()

    for straight, again in spawn(run, 2):
        for name in straight:
            assert torch.equal(again[name], straight[name]), name


def test_a_checkpoint_of_another_optimizer_restarts_the_step_count(tmp_path):
    def run(backend):
        model, opt = build(backend, compressed=False)
        train(model, opt, BATCHES[:2])
        checkpoint.save(tmp_path / "ddp", model, opt, step=2)
        trained, trained_opt = build(backend)
        train(trained, trained_opt, BATCHES[:4])         # compressing from its step 3
        fresh, fresh_opt = build(backend)
        for target, target_opt in ((trained, trained_opt), (fresh, fresh_opt)):
            checkpoint.load(tmp_path / "ddp", target, target_opt)
            train(target, target_opt, BATCHES[2:])
        return trained.gather_full_parameters(), fresh.gather_full_parameters()

    for trained, fresh in spawn(run, 2):
        for name in fresh:
            assert torch.equal(trained[name], fresh[name]), name
