"""The flags of ``distframe train`` and ``distframe generate`` and what each command prints.

Train flags mirror TrainConfig's fields (``--d-model`` is ``d_model``); only flags given on the
command line reach ``train_settings.resolve_config``, so they override ``--config`` and a resumed run's settings.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from distframe.train_config import (BACKENDS, COMPRESSORS, DEFAULT_TIMEOUT, DEFAULT_WORLD_SIZE, DTYPES,
                                    PRESETS, SCHEDULES, TOKEN_DTYPES, TrainConfig)
from distframe.train_settings import resolve_config
from distframe.train_strategies import BASE_OPTIMIZERS, OPTIMIZERS, STRATEGIES

EXIT_INTERRUPTED = 130


def _default(name: str) -> str:
    return f" (default: {getattr(TrainConfig, name)})"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(handler=train_command)
    add = _adder(parser)
    add("--config", metavar="FILE.toml", help="settings whose keys mirror these flags "
        "(d-model = 256, segment-lengths = [64, 128]); flags given here override it")
    run = parser.add_argument_group("strategy and ranks")
    add("--strategy", group=run, metavar="{" + ",".join(STRATEGIES) + "}",
        help="how the model is distributed: " + "; ".join(f"{k}: {s.help}"
                                                          for k, s in STRATEGIES.items()) + _default("strategy"))
    add("--backend", group=run, metavar="{" + ",".join(BACKENDS) + "}",
        help="communication engine; auto: mpi under mpiexec, gloo (nccl with a GPU per process) under "
             "torchrun, else in-memory threads" + _default("backend"))
    add("--timeout", group=run, type=float, metavar="SECONDS", help="how long a collective waits "
        f"for the other ranks before it fails naming them (default: {DEFAULT_TIMEOUT:g}; the elastic "
        "demo's 60)")
    add("--world-size", group=run, type=int, metavar="N",
        help=f"ranks to start: in-memory threads or spawned processes (default: {DEFAULT_WORLD_SIZE}); "
             "under mpiexec or torchrun the launcher decides")
    add("--dp", group=run, type=int, metavar="N", help="data-parallel degree of pipeline, "
        "tensor or hybrid (dp*tp*pp = world size; one left out is inferred)")
    add("--tp", group=run, type=int, metavar="N", help="tensor-parallel degree (tensor, hybrid); "
        "must divide --heads")
    add("--pp", group=run, type=int, metavar="N", help="pipeline stages (pipeline, hybrid)")
    add("--cp", group=run, type=int, metavar="N", help="context parallelism (hybrid): each sequence "
        "split across N ranks, attention as a ring; dp*tp*pp*cp = world size" + _default("cp"))
    add("--micro-batches", group=run, type=int, metavar="N", help="micro-batches per step through "
        "the pipeline; must divide --batch-size / --dp" + _default("micro_batches"))
    add("--schedule", group=run, metavar="{" + ",".join(SCHEDULES) + "}", help="pipeline "
        "schedule; interleaved_1f1b (Megatron's virtual pipeline stages) gives each rank "
        "--virtual-stages model chunks, shrinking the pipeline bubble, and needs --micro-batches "
        "a multiple of --pp" + _default("schedule"))
    add("--virtual-stages", group=run, type=int, metavar="V", help="model chunks per pipeline rank "
        "under --schedule interleaved_1f1b (2 or more; --pp x V stages, each at least one block, "
        "the embedding or the head)" + _default("virtual_stages"))
    _add_optimizer_arguments(parser, add)
    model = parser.add_argument_group("model (a preset, then overrides)")
    add("--preset", group=model, metavar="{" + ",".join(PRESETS) + "}", help="model shape" + _default("preset"))
    add("--layers", group=model, type=int, help="transformer blocks")
    add("--d-model", group=model, type=int, help="embedding width")
    add("--heads", group=model, type=int, help="attention heads")
    add("--seq-len", group=model, type=int, help="tokens per sequence")
    add("--segment-lengths", group=model, metavar="W1,W2,...",
        help="dilated attention segment lengths, each at most --seq-len")
    add("--dilation-rates", group=model, metavar="R1,R2,...",
        help="one dilation rate per segment length")
    add("--dropout", group=model, type=float, metavar="P", help="dropout probability, 0 <= P < 1 "
        "(residual stream, MLP, attention probabilities); each rank draws its masks from its own "
        "generator, seeded from --seed and saved with each checkpoint, so --resume continues them "
        "exactly (at another world size or strategy: new masks, seeded from --seed and the step)"
        + _default("dropout"))
    add("--activation-checkpointing", group=model, action="store_true", help="each block keeps "
        "only its input and recomputes its activations in backward (with the same dropout masks): "
        "less memory for longer sequences, about a third more compute; the same run otherwise")
    add("--compile", group=model, nargs="?", const="inductor", metavar="BACKEND",
        help="torch.compile each transformer block in place (inductor unless BACKEND names "
             "aot_eager or eager): the same run; the attention is one operator in the graph running "
             "its own kernels, so it is no faster on a CPU. Needs process ranks (gloo, mpi, "
             "nccl) or --world-size 1: in-memory ranks are threads, which refuse compiled models")
    add("--dtype", group=model, metavar="{" + ",".join(DTYPES) + "}", help="parameter dtype" + _default("dtype"))
    opt = parser.add_argument_group("optimisation")
    add("--steps", group=opt, type=int, help="optimizer steps" + _default("steps"))
    add("--batch-size", group=opt, type=int, help="global batch in sequences, split across the "
        "data-parallel ranks" + _default("batch_size"))
    add("--lr", group=opt, type=float, help="peak learning rate (linear warm-up, cosine to a "
        "tenth)" + _default("lr"))
    add("--warmup-steps", group=opt, type=int, help="warm-up steps; more than --steps and the "
        "peak --lr is never reached (warned as the run starts)" + _default("warmup_steps"))
    add("--weight-decay", group=opt, type=float, help="weight decay of the matrices (weights and "
        "embeddings); biases and norm weights get none" + _default("weight_decay"))
    add("--decay-all", group=opt, action="store_true", help="weight decay on every parameter, "
        "biases and norm weights too")
    add("--max-grad-norm", group=opt, type=float, metavar="F", help="clip the gradients by the whole "
        "model's norm before each step, as torch.nn.utils.clip_grad_norm_ on one process; 0: no "
        "clipping" + _default("max_grad_norm"))
    add("--grad-accum-steps", group=opt, type=int, metavar="N", help="run each rank's share of the "
        "batch in N equal pieces, one forward and backward at a time, synchronised once: the same "
        "step with 1/N of the activation memory (dropout masks aside)" + _default("grad_accum_steps"))
    add("--base-optimizer", group=opt, metavar="{" + ",".join(BASE_OPTIMIZERS) + "}",
        help="torch optimizer (--optimizer wraps it)" + _default("base_optimizer"))
    add("--seed", group=opt, type=int, help="seed of the initial model, the batches and the dropout "
        "masks" + _default("seed"))
    data = parser.add_argument_group("data and outputs")
    add("--data", group=data, metavar="PATH", help="a text file, a directory of text files (--out "
        "inside it left out) or a flat .bin token file; saved as an absolute path (default: the "
        "Python standard library's sources)")
    add("--token-dtype", group=data, metavar="{" + ",".join(TOKEN_DTYPES) + "}",
        help="dtype of a .bin token file" + _default("token_dtype"))
    add("--out", group=data, metavar="DIR", help="metrics.jsonl, config.json, loss.png and "
        "checkpoints/step-N; a fresh run replaces an earlier distframe run's there (its metrics and "
        "step-N checkpoints only) and refuses an OUT holding other files" + _default("out"))
    add("--resume", group=data, action="store_true", help="continue from the latest checkpoint in "
        "--out (at any world size or strategy); its saved settings (OUT/config.json, else the "
        "checkpoint's own) apply unless given here, but "
        "its model stays: the model flags and the data's vocabulary must match it (workers that "
        "torchrun restarts continue without it)")
    add("--checkpoint-every", group=data, type=int, metavar="STEPS", help="checkpoint interval; "
        "0: only at the end (--optimizer async: only at the end; an interval is refused)"
        + _default("checkpoint_every"))
    add("--eval-every", group=data, type=int, metavar="STEPS", help="validation interval; 0: only "
        "at the end (--optimizer async: only at the end)" + _default("eval_every"))
    add("--eval-batches", group=data, type=int, help="global batches per validation" + _default("eval_batches"))
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_optimizer_arguments(parser: argparse.ArgumentParser, add: Any) -> None:
    group = parser.add_argument_group("distributed optimizer (--optimizer and its settings)")
    add("--optimizer", group=group, metavar="{" + ",".join(OPTIMIZERS) + "}",
        help="; ".join(f"{k}: {c.help}" for k, c in OPTIMIZERS.items()) + _default("optimizer"))
    add("--compressor", group=group, metavar="{" + ",".join(COMPRESSORS) + "}",
        help="gradient compression of --optimizer compressed (error feedback for the lossy "
             "ones)" + _default("compressor"))
    add("--topk-ratio", group=group, type=float, metavar="F", help="fraction of the gradient "
        "--compressor topk sends" + _default("topk_ratio"))
    add("--powersgd-rank", group=group, type=int, metavar="R", help="rank of --compressor "
        "powersgd" + _default("powersgd_rank"))
    add("--powersgd-start", group=group, type=int, metavar="STEPS", help="uncompressed steps "
        "before powersgd starts" + _default("powersgd_start"))
    add("--max-staleness", group=group, type=int, metavar="N", help="--optimizer async (the server "
        "applies --lr's warm-up and cosine schedule by update): most "
        "updates between a worker's pull and its gradient's use" + _default("max_staleness"))
    add("--round-robin", group=group, action="store_true", help="--optimizer async: serve the "
        "workers in a fixed order (a reproducible run)")
    add("--commit-every", group=group, type=int, metavar="STEPS", help="--optimizer elastic: "
        "steps between in-memory commits (a failure rolls back to the last)"
        + _default("commit_every"))
    add("--elastic-schedule", group=group, metavar="STEP:WORLD,...", help="--optimizer elastic: "
        "after STEP steps (below --steps) the world becomes WORLD workers (e.g. 4:3,8:2)")
    add("--fail-at", group=group, type=int, metavar="STEP", help="--optimizer elastic: the last "
        "worker fails after STEP steps (once); the others go on without it")


def _adder(parser: argparse.ArgumentParser):
    def add(name: str, *, group: Any = None, **kwargs: Any) -> None:
        (group or parser).add_argument(name, default=argparse.SUPPRESS, **kwargs)
    return add


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(handler=generate_command)
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint directory (OUT/checkpoints/step-N) or a run's OUT "
                             "(its latest checkpoint)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=120, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0: all")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def train_command(args: argparse.Namespace) -> int:
    from distframe import train, train_checkpoint
    from distframe.cli import write_stdout
    from distframe.train_metrics import format_bytes, format_duration
    flags = {k: v for k, v in vars(args).items() if k not in ("handler", "command", "debug", "config")}
    # Said by rank 0 once the run has started (before its first step): a run refused for bad
    # input still reports one line, and under mpiexec or torchrun rank 0 alone says it.
    warnings: list[str] = []
    config = resolve_config(flags, getattr(args, "config", None), warn=warnings.append)
    try:
        result = train.run(config, start_notes=warnings)
    except KeyboardInterrupt:
        found = train_checkpoint.latest_checkpoint(config.out)
        where = (f"{found[0]} is the last complete checkpoint; continue with --resume"
                 if found else "no checkpoint was written yet")
        print(f"\ndistframe train: interrupted; {where}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.rank != 0:  # under mpiexec or torchrun every rank gets here; rank 0 reports
        return 0
    if result.already_finished:
        write_stdout(f"distframe train: the run in {config.out} already reached step {config.steps}; "
                     f"nothing to train (pass --steps above {config.steps} to train it further)\n")
        return 0
    for note in result.notes:
        print(note, file=sys.stderr)
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    train_loss = f"{result.train_loss:.4f}" if result.train_loss is not None else "n/a"
    write_stdout(f"distframe train: step {result.step}/{config.steps}, train loss {train_loss}, "
                 f"validation loss {val}, {result.tokens_per_s:,.0f} tokens/s, peak memory "
                 f"{format_bytes(result.peak_memory_bytes)}, {format_duration(result.wall_s)}; "
                 f"outputs in {result.out}"
                 + (f" (checkpoint {result.checkpoint})" if result.checkpoint else "") + "\n")
    return 0


def generate_command(args: argparse.Namespace) -> int:
    from distframe.cli import write_stdout
    from distframe.generate import generate_bytes
    out = generate_bytes(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    # The model is byte-level: its bytes go out as they are, which no stdout encoding can refuse
    # (print raised UnicodeEncodeError on a latin-1 one) and which loses none that is not UTF-8.
    write_stdout(out + b"\n")
    return 0
