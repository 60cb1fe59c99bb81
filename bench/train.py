"""Main-job throughput: tokens/s of ``distframe train`` under each data-parallel strategy at
world 2 (in-memory engine) beside a plain single-process PyTorch loop training the same model on
the same batches, and the validation loss each reaches after the same number of tokens.

    python bench/train.py                      # small preset, 20 steps of 4 x 1024 tokens
    python bench/train.py --steps 10 --strategies ddp,zero3

Tokens/s is the median over steps after the first (the first pays for allocation); the ratio
is strategy / plain loop, so 1.00 means no framework overhead. Same seed, same initial model,
same global batches and schedule everywhere, so the losses agree up to float32 rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# bench/attention.py would shadow the attention package: drop this script's folder from the path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from attention.model import DilatedTransformerLM  # noqa: E402
from distframe import train  # noqa: E402
from distframe.data import BatchSampler, load_corpus, validation_offsets  # noqa: E402
from distframe.train_config import TrainConfig  # noqa: E402
from distframe.train_loop import (base_optimizer, initial_model_state, learning_rate,  # noqa: E402
                                  next_token_loss)
from distframe.train_strategies import plain_optimizer  # noqa: E402


def plain_loop(config: TrainConfig) -> dict:
    """The same job with nothing but torch: one process, the whole global batch."""
    corpus = load_corpus(config.data)
    model = DilatedTransformerLM(config.model_config(vocab_size=corpus.vocab_size))
    model.load_state_dict(initial_model_state(config, corpus.vocab_size))
    optimizer = plain_optimizer(model, *base_optimizer(model, config))  # the CLI's groups
    seq_len = model.config.seq_len
    data = BatchSampler(corpus.train, batch_size=config.batch_size, seq_len=seq_len, seed=config.seed)
    rates, losses = [], []
    for step in range(1, config.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        inputs, targets = data.slice(step, 0, 1)
        started = time.perf_counter()
        loss = next_token_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rates.append(config.batch_size * seq_len / (time.perf_counter() - started))
        losses.append(loss.item())
    val = BatchSampler(corpus.validation, batch_size=config.batch_size, seq_len=seq_len, seed=0)
    with torch.no_grad():
        val_losses = [float(next_token_loss(model(i), t)) for i, t in (
            val.windows(o, 0, 1) for o in validation_offsets(
                len(corpus.validation), batches=config.eval_batches,
                batch_size=config.batch_size, seq_len=seq_len))]
    return {"tokens_per_s": statistics.median(rates[1:] or rates), "train_loss": losses[-1],
            "val_loss": sum(val_losses) / len(val_losses), "peak_memory_bytes": None}


def strategy_run(config: TrainConfig) -> dict:
    train.run(config)
    with open(os.path.join(config.out, "metrics.jsonl"), encoding="utf-8") as f:
        metrics = [json.loads(line) for line in f]
    rates = [m["tokens_per_s"] for m in metrics]
    return {"tokens_per_s": statistics.median(rates[1:] or rates),
            "train_loss": metrics[-1]["train_loss"], "val_loss": metrics[-1]["val_loss"],
            "peak_memory_bytes": metrics[-1]["peak_memory_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench-train-")
    base = TrainConfig(preset=args.preset, steps=args.steps, batch_size=args.batch_size,
                       eval_every=0, checkpoint_every=0, world_size=args.world_size,
                       backend="inmemory", out=out)
    tokens = args.steps * args.batch_size * base.model_config(vocab_size=256).seq_len
    print(f"# {args.preset} preset, {args.steps} steps x {args.batch_size} sequences = "
          f"{tokens} tokens, torch {torch.__version__}, {os.cpu_count()} cores", flush=True)
    print("| run | tokens/s | ratio to plain | train loss | val loss |")
    print("|---|---:|---:|---:|---:|")
    plain = plain_loop(base)
    print(f"| plain PyTorch, 1 process | {plain['tokens_per_s']:.0f} | 1.00 | "
          f"{plain['train_loss']:.4f} | {plain['val_loss']:.4f} |", flush=True)
    for strategy in args.strategies.split(","):
        config = TrainConfig(**{**base.to_json(), "strategy": strategy,
                                "out": os.path.join(out, strategy)})
        try:
            result = strategy_run(config)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next strategy
            print(f"| {strategy}, world {args.world_size} | failed: {str(exc).splitlines()[0][:80]} | | | |")
            continue
        print(f"| {strategy}, world {args.world_size} | {result['tokens_per_s']:.0f} | "
              f"{result['tokens_per_s'] / plain['tokens_per_s']:.2f} | {result['train_loss']:.4f} | "
              f"{result['val_loss']:.4f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
