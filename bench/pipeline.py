"""Pipeline parallelism: steps/s against torch.distributed.pipelining, measured bubble against
(p-1)/(m+p-1), and peak saved-activation memory of 1F1B against GPipe.

    python bench/pipeline.py [--steps 8] [--quick] [--only throughput,sleep,memory,spread,threads]

1. Throughput (gloo, 2 processes, one thread each): an ``nn.Sequential`` of residual MLP blocks
   (float32) cut into 2 stages by distframe's splitter; the very same stage modules run under
   distframe's PipelineParallelModel and under torch's ``PipelineStage`` + ``ScheduleGPipe`` /
   ``Schedule1F1B`` (SGD step included in both), alternately in the same processes (distframe
   first on even steps, torch first on odd ones, each after the raw process group's barrier;
   before the nineteenth session distframe always went first, after the engine's own barrier).
   Figure: median steps/s over the timed steps; ratio distframe / torch.
2. Bubble, real compute (the same gloo run): per-stage busy time from the runtime's timeline,
   idle = pipeline span - busy; the mean idle fraction against the formula, and against the
   bubble replayed from the step's own op times with free messages (``replayed_bubble``):
   measured - replayed is what messages and scheduling cost, replayed - formula what unequal
   and varying compute times cost.
3. Bubble, schedule only (in-memory threads): stages whose compute is a fixed sleep (forward t,
   backward 2t), so p = 4 stages do not compete for 2 cores; p = 4, m = 4, 8, 16; GPipe, 1F1B
   and interleaved 1F1B with v = 2 chunks per rank (formula (p-1)/(v*m+p-1)).
4. Memory (in-memory threads, p = 4, m = 8), GPipe vs 1F1B, one step after an untimed one: peak
   bytes of storage saved for backward on each stage (``ActivationMemoryMeter``:
   saved_tensors_hooks, unique storages: the library's own count) and, since the twenty-fourth
   session, the peak of real tensor storage on the stage's thread beyond its parameters and
   gradients (``bench/_storage.PeakStorage``: everything else its ops make, sent and received
   tensors and the loss's too).
5. Op-time spread: the throughput part's stage alone in one process (m = 8, no messages, one
   thread): how much its forward and backward times vary from one micro-batch to the next.
6. Bubble, real compute on in-memory threads (p = 2): the throughput part's stages and batches
   with messages that are handovers between threads.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

# bench/ goes last on the path: bench/attention.py must not shadow the attention package.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH)] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]

WIDTH, BLOCKS, BATCH = 512, 8, 64


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)])


def batch(step: int, size: int = BATCH):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, WIDTH, generator=g), torch.randn(size, WIDTH, generator=g)


def mse(out, target):
    return F.mse_loss(out, target)


# ---- 1 and 2: gloo, distframe vs torch.distributed.pipelining ---------------------------------
def _rank_throughput(backend, configs, steps, warmup, batch_size):
    import torch.distributed as dist
    from _gloo_collectives import _join_raw_world
    from distframe.models.pipeline import PipelineParallelModel
    from distframe.models.stages import split_into_stages
    torch.set_num_threads(1)
    _join_raw_world(backend)
    rows = []
    try:
        for schedule, m in configs:
            ours = PipelineParallelModel(build_model(), backend, num_microbatches=m, schedule=schedule)
            opt = torch.optim.SGD(ours.parameters(), lr=1e-3)
            stage = split_into_stages(build_model(), backend.world_size)[backend.rank]
            theirs, their_opt = _torch_schedule(stage, backend, schedule, m)
            ours_times, theirs_times, timelines = [], [], []
            for s in range(warmup + steps):
                x, y = batch(s, batch_size)
                # Alternating: distframe first on even steps, torch first on odd ones; both sides
                # start after the same barrier (the raw process group's, which runs no engine code).
                for side in ("ours", "theirs") if s % 2 == 0 else ("theirs", "ours"):
                    dist.barrier()
                    start = time.perf_counter()
                    if side == "ours":
                        ours.train_step((x, y), mse, opt)
                        ours_times.append(time.perf_counter() - start)
                        timelines.append(ours.last_timeline)
                    else:
                        _torch_step(theirs, their_opt, backend, x, y)
                        theirs_times.append(time.perf_counter() - start)
            rows.append({"schedule": schedule, "m": m, "ours_s": ours_times[warmup:],
                         "torch_s": theirs_times[warmup:], "timelines": timelines[warmup:]})
    finally:
        dist.destroy_process_group()
    return rows


def _torch_schedule(stage_module, backend, schedule, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(stage_module, backend.rank, backend.world_size, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches=m, loss_fn=mse), torch.optim.SGD(stage_module.parameters(), lr=1e-3)


def _torch_step(schedule, opt, backend, x, y):
    import torch.distributed as dist
    last = backend.world_size - 1
    losses = []
    if backend.rank == 0:
        schedule.step(x)
    elif backend.rank == last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad()
    # The same loss broadcast distframe's train_step does (every rank returns the loss).
    loss = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
    dist.broadcast(loss, last)


def throughput(configs, steps, warmup, batch_size=BATCH):
    from distframe._process_launch import ProcessPool
    from distframe.models.pipeline_metrics import pipeline_bubble, replayed_bubble
    with ProcessPool(2, "gloo", timeout=600) as pool:
        per_rank = pool.run(_rank_throughput, configs, steps, warmup, batch_size)
    p = 2
    print(f"\n## Throughput and bubble: gloo, p={p}, {BLOCKS} blocks of width {WIDTH}, batch {batch_size}, "
          "float32, 1 thread per rank")
    print("| schedule | m | distframe steps/s | torch.pipelining steps/s | ratio | measured bubble "
          "| replayed (own op times, free messages) | (p-1)/(m+p-1) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, row in enumerate(per_rank[0]):
        # A step's time is the slowest rank's.
        ours = statistics.median(max(t) for t in zip(*(r[i]["ours_s"] for r in per_rank)))
        theirs = statistics.median(max(t) for t in zip(*(r[i]["torch_s"] for r in per_rank)))
        steps = [[r[i]["timelines"][k] for r in per_rank] for k in range(len(row["timelines"]))]
        formula = (p - 1) / (row["m"] + p - 1)
        print(f"| {row['schedule']} | {row['m']} | {1 / ours:.2f} | {1 / theirs:.2f} | {theirs / ours:.2f}x "
              f"| {statistics.median(map(pipeline_bubble, steps)):.3f} "
              f"| {statistics.median(map(replayed_bubble, steps)):.3f} | {formula:.3f} |")


# ---- 3: schedule-only bubble ----------------------------------------------------------------------
def sleep_bubble(p, ms, seconds, steps):
    from distframe.launch import spawn
    from distframe.models.pipeline import PipelineParallelModel
    from distframe.models.pipeline_metrics import SleepStage, pipeline_bubble, replayed_bubble
    print(f"\n## Bubble, schedule only: in-memory threads, p={p}, stage compute = sleep "
          f"(forward {seconds * 1e3:.0f} ms, backward {2 * seconds * 1e3:.0f} ms per micro-batch)")
    print("| schedule | m | measured bubble | replayed | (p-1)/(v*m+p-1) | measured vs formula |")
    print("|---|---|---|---|---|---|")
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in ms:
            # Interleaving: p * v chunks of t / v each, so a rank's compute per micro-batch is t.
            model = nn.Sequential(*[SleepStage(seconds / v) for _ in range(p * v)])
            x, y = torch.ones(m, 2), torch.zeros(m, 2)

            def run(b):
                pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=m, schedule=schedule,
                                             virtual_stages=v)
                out = []
                for _ in range(steps + 1):  # the first step also pays one-off costs: not timed
                    b.barrier()
                    pipe.forward_backward((x, y), mse)
                    out.append(pipe.last_timeline)
                return out[1:]

            per_rank = spawn(run, p)
            measured = statistics.median(pipeline_bubble([r[k] for r in per_rank]) for k in range(steps))
            replayed = statistics.median(replayed_bubble([r[k] for r in per_rank]) for k in range(steps))
            formula = (p - 1) / (v * m + p - 1)
            print(f"| {schedule}{f' (v={v})' if v > 1 else ''} | {m} | {measured:.3f} | {replayed:.3f} | {formula:.3f} "
                  f"| {(measured - formula) / formula:+.1%} |")


# ---- 5: how much one stage's op times vary with nothing else running --------------------------
def op_spread(m, steps, batch_size):
    """One stage (half the blocks) alone in this process, one thread, no messages: m forwards then
    m backwards per step as GPipe runs them, gradients set to None between steps as the pipeline's
    optimizer does. The spread here is what the replayed bubble inherits on this machine."""
    torch.set_num_threads(1)
    stage = build_model()[:BLOCKS // 2]
    rows = batch_size // m
    times = {"forward": [[] for _ in range(m)], "backward": [[] for _ in range(m)]}
    for step in range(steps + 2):  # two untimed steps first
        inputs = [torch.randn(rows, WIDTH, requires_grad=True) for _ in range(m)]
        outputs = []
        for i, x in enumerate(inputs):
            start = time.perf_counter()
            outputs.append(stage(x))
            if step >= 2:
                times["forward"][i].append(time.perf_counter() - start)
        for i, y in enumerate(outputs):
            start = time.perf_counter()
            y.backward(torch.ones_like(y))
            if step >= 2:
                times["backward"][i].append(time.perf_counter() - start)
        for param in stage.parameters():
            param.grad = None
    print(f"\n## Op-time spread of one stage alone: {BLOCKS // 2} blocks of width {WIDTH}, micro-batch "
          f"{rows} rows, m={m}, {steps} steps, 1 thread, no messages")
    print("| op | median ms | sd / median | min ms | max ms | median of the step's first op / all |")
    print("|---|---|---|---|---|---|")
    for op, per_position in times.items():
        every = [t * 1e3 for ts in per_position for t in ts]
        median = statistics.median(every)
        first = statistics.median(per_position[0]) * 1e3
        print(f"| {op} | {median:.2f} | {statistics.stdev(every) / median:.3f} | {min(every):.2f} "
              f"| {max(every):.2f} | {first / median:.3f} |")


# ---- 4: activation memory ---------------------------------------------------------------------------
def _storage_beyond_state(parameters):
    """A ``PeakStorage`` whose ``beyond_peak`` is the peak, taken after every op, of the live
    storage that is neither one of ``parameters`` nor the ``.grad`` they hold then. A gradient
    counts as a gradient once autograd has stored it in ``.grad``: the op that computes it counts it
    until then."""
    from _storage import PeakStorage

    class StorageBeyondState(PeakStorage):
        beyond_peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            state = {t.untyped_storage().data_ptr() for p in parameters for t in (p, p.grad)
                     if t is not None}
            held = sum(self.live[key][1] for key in state if key in self.live)
            self.beyond_peak = max(self.beyond_peak, self.current - held)
            return out
    return StorageBeyondState()


def activation_memory(p, m):
    """Per stage: the saved-activation meter's peak (the library's own count) and, over the same
    step, the peak of real storage beyond the stage's parameters and gradients (bench/_storage.py:
    activations, received and sent tensors, the micro-batches, transient gradients)."""
    from distframe.launch import spawn
    from distframe.models.pipeline import PipelineParallelModel
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(128) for _ in range(2 * p)])
    x, y = torch.randn(8 * m, 128), torch.randn(8 * m, 128)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        def run(b):
            pipe = PipelineParallelModel(copy.deepcopy(model), b, num_microbatches=m, schedule=schedule)
            pipe.forward_backward((x, y), mse)  # untimed: the first step's one-off allocations
            parameters = list(pipe.parameters())
            for param in parameters:
                param.grad = None
            pipe.activation_memory.enabled = True
            with _storage_beyond_state(parameters) as storage:
                pipe.forward_backward((x, y), mse)
            return pipe.activation_memory.peak_bytes, pipe.runner.in_flight_peak, storage.beyond_peak
        peaks[schedule] = spawn(run, p)
    print(f"\n## Peak activation memory: in-memory, p={p}, m={m}, {2 * p} blocks of width 128, "
          f"micro-batch 8; meter = saved_tensors_hooks, unique storages (the library's count); "
          f"storage = real storage beyond the stage's parameters and gradients (bench/_storage.py)")
    print("| stage | GPipe meter KiB (in flight) | 1F1B meter KiB (in flight) | 1F1B / GPipe meter "
          "| GPipe storage KiB | 1F1B storage KiB | 1F1B / GPipe storage |")
    print("|---|---|---|---|---|---|---|")
    for s in range(p):
        (g, gf, gs), (o, of, os_) = peaks["gpipe"][s], peaks["1f1b"][s]
        print(f"| {s} | {g / 1024:.1f} ({gf}) | {o / 1024:.1f} ({of}) | {o / g:.3f} "
              f"| {gs / 1024:.1f} | {os_ / 1024:.1f} | {os_ / gs:.3f} |")


# ---- 6: real compute, messages that cost (almost) nothing ---------------------------------------
def threads_bubble(configs, steps, warmup, batch_size):
    """The throughput part's stages and batches on in-memory threads (p = 2, one thread each):
    a message is a handover between threads, so measured - replayed shrinks to the schedule's own
    cost and what is left over the formula is the compute's."""
    from distframe.launch import spawn
    from distframe.models.pipeline import PipelineParallelModel
    from distframe.models.pipeline_metrics import pipeline_bubble, replayed_bubble

    def run(backend):
        out = []
        for schedule, m in configs:
            model = PipelineParallelModel(build_model(), backend, num_microbatches=m, schedule=schedule)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            timelines = []
            for s in range(warmup + steps):
                backend.barrier()
                model.train_step(batch(s, batch_size), mse, opt)
                timelines.append(model.last_timeline)
            out.append(timelines[warmup:])
        return out

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # process-wide: each rank thread computes on its own
    try:
        per_rank = spawn(run, 2)
    finally:
        torch.set_num_threads(previous)
    print(f"\n## Bubble, real compute on in-memory threads: p=2, {BLOCKS} blocks of width {WIDTH}, "
          f"batch {batch_size}, 1 thread per rank, median of {steps} steps")
    print("| schedule | m | measured bubble | replayed | (p-1)/(m+p-1) | measured vs formula |")
    print("|---|---|---|---|---|---|")
    for i, (schedule, m) in enumerate(configs):
        step_timelines = [[r[i][k] for r in per_rank] for k in range(steps)]
        measured = statistics.median(map(pipeline_bubble, step_timelines))
        replayed = statistics.median(map(replayed_bubble, step_timelines))
        formula = 1 / (m + 1)
        print(f"| {schedule} | {m} | {measured:.3f} | {replayed:.3f} | {formula:.3f} "
              f"| {(measured - formula) / formula:+.1%} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (throughput, threads)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--quick", action="store_true", help="fewer configurations and steps")
    parser.add_argument("--only", default="throughput,sleep,memory,spread,threads",
                        help="comma-separated parts: throughput (1 and 2, gloo), sleep (3), "
                        "memory (4), spread (5), threads (6)")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help="global batch of the throughput part (split into m micro-batches)")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    configs = [("gpipe", 4), ("1f1b", 4), ("gpipe", 8), ("1f1b", 8)]
    if args.quick:
        configs, args.steps = configs[:2], 3
    if "throughput" in parts:
        throughput(configs, args.steps, args.warmup, args.batch)
    if "sleep" in parts:
        sleep_bubble(4, [4] if args.quick else [4, 8, 16], 0.02, 2 if args.quick else 3)
    if "memory" in parts:
        activation_memory(4, 8)
    if "spread" in parts:
        op_spread(8, 3 if args.quick else 12, args.batch)
    if "threads" in parts:
        threads_bubble(configs, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()
