"""Steps/s and per-rank memory of the data-parallel strategies (world 2), beside torch DDP and
torch FSDP2 (``fully_shard``) on gloo, in one run.

Model: a ~5M-parameter decoder (4 blocks, d_model 256, 4 heads, vocab 4096, untied head),
sequence 256, batch 8 per rank, AdamW; fresh processes (gloo) or threads (in-memory). Each side runs
one untimed first step, ``--warmup`` untimed training steps (``train_step`` for ours), ``--steps`` timed.

Columns: steps/s; ``state MiB`` = memory_footprint() right after the first optimizer step
(parameters, gradients, optimizer state, buffers: the code's own bookkeeping) with, beside it,
``gc state`` = the unique storage of every tensor reachable from Python then, less what was
reachable before the model was built (process engines only: in-memory ranks share one process),
and the ZeRO formula; ``peak MiB`` =
the process's peak RSS (VmHWM, reset just before the model is built) minus its RSS then (process engines only: the
in-memory ranks share one process); ``live MiB`` = the peak of live tensor storage over one more
step after the timed ones, every storage counted once (model, gradients, optimizer state,
activations, gathered parameters, the collectives' outputs: bench/_storage.py), which is what
the tensors need, where RSS adds what the allocator keeps. Every process engine row, torch's included, starts its ranks
with multiprocessing's "spawn": a forked rank (distframe's default forkserver) starts with few
of the shared libraries' pages mapped, faults them in during the first step and so shows ~10-40
MiB more "peak" for the same allocations.

When DeepSpeed is installed (an optional baseline, never a dependency:
``DS_BUILD_OPS=0 pip install -c constraints.txt deepspeed``; unpinned, it pulls a CUDA torch),
its ZeRO-1 and ZeRO-2 run on gloo too (CPU accelerator, torch's AdamW as the client optimizer),
right before our ZeRO-1/2 rows. ``vs base`` is a gloo row's steps/s over its baseline's in
this run: torch DDP for DDPModel, FSDP2 for FSDPModel, DeepSpeed's stage for ZeRO-1/2.

Then, because a step's time swings by up to 10% between runs on 2 shared cores, the speed
ratios the targets name are measured once more with both sides in the same two processes:
DDPModel beside torch DDP and FSDPModel beside FSDP2 (gloo), and with DeepSpeed installed ZeRO-1/2
beside its stages, alternating step by step (ours first on even steps), ``--pair-steps`` steps
each; the figures are speed ratios (above 1: ours faster): the baseline's median step time over
ours, and ("paired speed ratio") the median over steps of the baseline's step time over ours in
the same step. (bench/collectives.py's "paired time ratio" is the other way up: engine time over
raw time, below 1 faster.)

    python bench/data_parallel.py [--steps 5] [--warmup 1] [--only ddp,fsdp] [--pair-steps 12]
    python bench/data_parallel.py --only gloo:torch-fsdp2,gloo:fsdp    # just the FSDP pair
    python bench/data_parallel.py --only pairs                         # just the interleaved ratios
    python bench/data_parallel.py --only pairs --pairs ddp --pair-steps 40   # one pair, longer
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

# Run as a script, this folder comes first on sys.path and its attention.py would shadow the
# top-level ``attention`` package that distframe imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH, WORLD = 4096, 256, 4, 4, 256, 8, 2
# The baseline each gloo row is divided by in the "vs base" column (when both ran).
BASELINE = {"gloo:ddp": "gloo:torch-ddp", "gloo:fsdp": "gloo:torch-fsdp2",
            "gloo:ddp-unused": "gloo:torch-ddp-unused",
            "gloo:zero1": "gloo:deepspeed-zero1", "gloo:zero2": "gloo:deepspeed-zero2"}
FORMULA = {"ddp": 16, "zero1": 8 + 8 / WORLD, "zero2": 4 + 12 / WORLD, "zero3": 16 / WORLD,
           "fsdp": 16 / WORLD}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.up = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.down = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        # (B, nh, T, hs)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def batch_for(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _meters():
    """bench/_storage.py: peak RSS, peak live tensor storage, storage reachable from Python."""
    sys.path.append(_HERE)  # after the packages: this folder's attention.py must not shadow one
    import _storage
    return _storage


def reset_peak() -> float:
    return _meters().reset_peak_rss()


def peak_rss_mib() -> float:
    return _meters().peak_rss_mib()


def live_peak_mib(step) -> float:
    return _meters().live_peak(step) / 2**20


def reachable_mib() -> float:
    return _meters().reachable_bytes() / 2**20


# ---- distframe strategies ------------------------------------------------------------------------
def strategies() -> dict[str, tuple[type, type]]:
    """Strategy name -> (model class, optimizer class)."""
    from distframe.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
    from distframe.optimizers import (DDPOptimizer, FSDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer,
                                      ZeRO3Optimizer)
    return {"ddp": (DDPModel, DDPOptimizer), "zero1": (ZeRO1Model, ZeRO1Optimizer),
            "zero2": (ZeRO2Model, ZeRO2Optimizer), "zero3": (ZeRO3Model, ZeRO3Optimizer),
            "fsdp": (FSDPModel, FSDPOptimizer)}


def run_distframe(backend, strategy: str, steps: int, warmup: int):
    torch.set_num_threads(1)
    counted = backend.engine != "inmemory"  # in-memory ranks share one process: gc sees them all
    reachable_before = reachable_mib() if counted else None
    before = reset_peak()
    model_cls, opt_cls = strategies()[strategy]
    model = model_cls(build(), backend)
    opt = opt_cls(model, torch.optim.AdamW, lr=3e-4)
    x, y = batch_for(backend.rank, 0)
    lm_loss(model(x), y).backward()
    opt.step()
    state = model.memory_footprint()["total"]
    del x, y
    gc_state = reachable_mib() - reachable_before if counted else None
    opt.zero_grad()
    for s in range(1, 1 + warmup):  # as many as torch's side: see the module docstring
        model.train_step(batch_for(backend.rank, s), lm_loss, opt)
    backend.barrier()
    start = time.perf_counter()
    for s in range(steps):
        model.train_step(batch_for(backend.rank, 1 + warmup + s), lm_loss, opt)
    elapsed = time.perf_counter() - start
    peak = peak_rss_mib() - before
    live = None if backend.engine == "inmemory" else live_peak_mib(
        lambda: model.train_step(batch_for(backend.rank, 1 + warmup + steps), lm_loss, opt))
    return {"steps_per_s": steps / elapsed, "state": state, "gc_state": gc_state, "peak": peak,
            "live": live}


# ---- torch baselines (own process group) ---------------------------------------------------------
def torch_baseline(kind: str):
    """The model wrapped by torch DDP (``torch-ddp``), FSDP2 (``torch-fsdp2``: each block, then
    the root) or DeepSpeed (``deepspeed-zero1``/``-zero2``) on the default process group, and its
    AdamW (for DeepSpeed: its engine, which steps the AdamW, and None)."""
    model = build()
    if kind.startswith("deepspeed-"):
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(kind[-1])}, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                                          config=config)
        return engine, None
    if kind.startswith("torch-ddp"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, find_unused_parameters=kind.endswith("-unused"))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def torch_step(model, opt, batch) -> None:
    """One step as our train_step takes it, the global loss's all_reduce included."""
    import torch.distributed as dist
    loss = lm_loss(model(batch[0]), batch[1])
    if opt is None:  # a DeepSpeed engine: its backward reduces, its step updates and zeroes
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.all_reduce(loss.detach())


def _deepspeed_env(rank: int) -> None:
    """Sets what DeepSpeed's launcher would (it checks LOCAL_RANK), selects its CPU accelerator,
    and imports it. ``deepspeed.initialize`` then joins the default gloo process group, so every
    collective runs on gloo: its shared-memory all-reduce turns on only with the launcher's LOCAL_SIZE, left
    unset here so that both sides of a comparison use the same transport."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))
    importlib.import_module("deepspeed")


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _torch_worker(rank: int, kind: str, steps: int, warmup: int, port: int, out) -> None:
    try:
        _torch_rank(rank, kind, steps, warmup, port, out)
    except BaseException as exc:  # the parent waits on the queue: tell it, or it waits forever
        out.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _torch_rank(rank: int, kind: str, steps: int, warmup: int, port: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    if kind.startswith("deepspeed-"):
        _deepspeed_env(rank)  # imported before the peak is reset, like torch
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    before = reset_peak()
    model, opt = torch_baseline(kind)

    def step(s):
        torch_step(model, opt, batch_for(rank, s))
    for s in range(1 + warmup):  # the first step, then --warmup: as ours
        step(s)
    dist.barrier()
    start = time.perf_counter()
    for s in range(steps):
        step(1 + warmup + s)
    elapsed = time.perf_counter() - start
    peak = peak_rss_mib() - before
    live = live_peak_mib(lambda: step(1 + warmup + steps))
    out.put((rank, {"steps_per_s": steps / elapsed, "state": None, "gc_state": None, "peak": peak,
                    "live": live}))
    dist.destroy_process_group()


def run_torch(kind: str, steps: int, warmup: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_torch_worker, args=(r, kind, steps, warmup, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"{kind}: rank(s) failed: {failed}")
    return [results[r] for r in range(WORLD)]


# ---- the same two processes, alternating ------------------------------------------------------
def run_pairs(backend, steps: int, warmup: int, pairs: list[str]) -> dict[str, tuple[float, float, float]]:
    """(ours, theirs, paired) for each pair timed alternately in these processes: median step
    times and the median over steps of their time over ours in the same step."""
    import torch.distributed as dist
    sys.path.append(_HERE)
    from _gloo_collectives import _join_raw_world
    torch.set_num_threads(1)
    _join_raw_world(backend)
    names = [name for name in pairs if name in ("ddp", "ddp-unused", "fsdp")]
    if _has_deepspeed() and any(name in ("zero1", "zero2") for name in pairs):
        _deepspeed_env(backend.rank)
        names += [name for name in pairs if name in ("zero1", "zero2")]
    try:
        return {name: _time_pair(backend, name, steps, warmup) for name in names}
    finally:
        dist.destroy_process_group()


def _time_pair(backend, name: str, steps: int, warmup: int) -> tuple[float, float, float]:
    import statistics

    # ddp-unused: both sides with find_unused_parameters=True (every parameter is used: its cost)
    model_cls, opt_cls = strategies()[name.removesuffix("-unused")]
    ours = model_cls(build(), backend, **({"find_unused_parameters": True} if name == "ddp-unused" else {}))
    ours_opt = opt_cls(ours, torch.optim.AdamW, lr=3e-4)
    theirs, their_opt = torch_baseline(BASELINE[f"gloo:{name}"].removeprefix("gloo:"))
    steps_of = (lambda batch: ours.train_step(batch, lm_loss, ours_opt),
                lambda batch: torch_step(theirs, their_opt, batch))
    times: tuple[list[float], list[float]] = ([], [])
    for s in range(warmup + steps):
        batch = batch_for(backend.rank, s)
        for which in ((0, 1) if s % 2 == 0 else (1, 0)):
            backend.barrier()
            start = time.perf_counter()
            steps_of[which](batch)
            if s >= warmup:
                times[which].append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    backend.all_reduce(slowest, op="max")  # a step lasts until its slower rank is done
    return (statistics.median(slowest[0].tolist()), statistics.median(slowest[1].tolist()),
            statistics.median((slowest[1] / slowest[0]).tolist()))


def print_pairs(steps: int, warmup: int, pairs: list[str]) -> None:
    from distframe.launch import spawn
    results = spawn(functools.partial(run_pairs, steps=steps, warmup=warmup, pairs=pairs), WORLD, "gloo",
                    timeout=1800, start_method="spawn")[0]
    print(f"\ninterleaved in the same processes ({steps} steps each, after {warmup} warm-up):")
    print(f"{'pair':<24} {'ours ms':>8} {'base ms':>9} {'speed ratio':>12} {'paired speed ratio':>19}")
    labels = {"ddp": "DDPModel / torch DDP", "fsdp": "FSDPModel / FSDP2",
              "ddp-unused": "DDP find_unused / torch",
              "zero1": "ZeRO-1 / DeepSpeed", "zero2": "ZeRO-2 / DeepSpeed"}
    for name, (ours, theirs, paired) in results.items():
        label = labels[name]
        print(f"{label:<24} {ours * 1e3:8.1f} {theirs * 1e3:9.1f} {theirs / ours:12.3f} {paired:19.3f}",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    parser.add_argument("--only", default="", help="comma-separated subset of the rows ('pairs': "
                        "the interleaved speed ratios)")
    parser.add_argument("--pair-steps", type=int, default=12, help="timed steps per side of each pair")
    parser.add_argument("--pairs", default="ddp,fsdp,zero1,zero2",
                        help="which pairs to time (zero1/zero2 only with DeepSpeed installed; "
                        "ddp-unused: DDP with find_unused_parameters=True on both sides)")
    args = parser.parse_args(argv)
    from distframe.launch import spawn
    # Each torch baseline runs right beside its counterpart, so load changes hit both alike.
    rows = [("gloo:torch-ddp", "torch", "torch-ddp"), ("gloo:ddp", "gloo", "ddp"),
            ("inmemory:ddp", "inmemory", "ddp"), ("gloo:torch-fsdp2", "torch", "torch-fsdp2"),
            ("gloo:fsdp", "gloo", "fsdp"), ("inmemory:fsdp", "inmemory", "fsdp")]
    deepspeed = _has_deepspeed()
    for s in ("zero1", "zero2", "zero3"):
        if deepspeed and s != "zero3":  # DeepSpeed's ZeRO-1/2: an optional column, never a dependency
            rows.append((f"gloo:deepspeed-{s}", "torch", f"deepspeed-{s}"))
        rows += [(f"{e}:{s}", e, s) for e in ("gloo", "inmemory")]
    only = set(filter(None, args.only.split(",")))
    params = sum(p.numel() for p in build().parameters())
    print(f"model: {params / 1e6:.2f}M parameters, seq {SEQ}, batch {BATCH}/rank, world {WORLD}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}"
          + ("" if deepspeed else "; DeepSpeed not installed: no DeepSpeed rows"))
    print(f"{'configuration':<22} {'steps/s':>8} {'vs base':>8} {'state MiB':>10} {'gc state':>9} "
          f"{'formula MiB':>12} {'peak MiB':>9} {'live MiB':>9}")
    speeds: dict[str, float] = {}
    for label, engine, kind in rows:
        if only and kind not in only and label not in only:
            continue
        if engine == "torch":
            results = run_torch(kind, args.steps, args.warmup)
        else:
            start_method = {} if engine == "inmemory" else {"start_method": "spawn"}
            results = spawn(functools.partial(run_distframe, strategy=kind, steps=args.steps,
                                              warmup=args.warmup), WORLD, engine, timeout=600, **start_method)
        r = results[0]
        state = f"{r['state'] / 2**20:10.2f}" if r["state"] is not None else f"{'-':>10}"
        gc_state = f"{r['gc_state']:9.2f}" if r.get("gc_state") is not None else f"{'-':>9}"
        formula = f"{FORMULA[kind] * params / 2**20:12.2f}" if kind in FORMULA else f"{'-':>12}"
        peak = f"{max(x['peak'] for x in results):9.1f}" if engine != "inmemory" else f"{'-':>9}"
        speeds[label] = min(x["steps_per_s"] for x in results)
        base = speeds.get(BASELINE.get(label, ""))
        ratio = f"{speeds[label] / base:8.3f}" if base else f"{'-':>8}"
        live = f"{max(x['live'] for x in results):9.1f}" if results[0]["live"] is not None else f"{'-':>9}"
        print(f"{label:<22} {speeds[label]:8.3f} {ratio} {state} {gc_state} {formula} {peak} {live}",
              flush=True)
    if not only or "pairs" in only:
        print_pairs(args.pair_steps, max(args.warmup, 1), args.pairs.split(","))


if __name__ == "__main__":
    sys.exit(main())
