"""``distframe train --compile`` against eager training: one training step of the dilated-attention
LM (forward, cross-entropy, backward, AdamW), eager and with each block compiled in place
(``block.compile()``, what ``--compile`` does), on one device, in the same run. Prints the median
and minimum step time of ``--steps`` timed steps after 3 warm-ups (the first compiles: its time is
printed as the compile cost), the ratio eager / compiled (above 1: compiling is faster), and both
runs' last loss. The two models train side by side, one step of each in turn, on the same
batches. Sizes: ``small`` (the small preset, batch 8), ``8k`` (8,192 tokens, width 1024, 16 heads,
8 blocks, segments 1k-8k at rates 1-8, batch 2) and ``32k`` (32,768 tokens, width 1024, 16 heads,
4 blocks, segments 2k-32k at rates 1-16, batch 1). Inductor needs Triton on a GPU and a
C compiler on a CPU.

    python bench/compile_lm.py --device cuda --dtype bfloat16 --sizes small,8k,32k
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))  # bench/attention.py would shadow the package
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention.model import DilatedTransformerConfig, DilatedTransformerLM  # noqa: E402

SIZES = {
    "small": (dict(), 8),
    "8k": (dict(seq_len=8192, embed_dim=1024, num_heads=16, num_layers=8,
                segment_lengths=(1024, 2048, 4096, 8192), dilation_rates=(1, 2, 4, 8)), 2),
    "32k": (dict(seq_len=32768, embed_dim=1024, num_heads=16, num_layers=4,
                 segment_lengths=(2048, 4096, 8192, 16384, 32768), dilation_rates=(1, 2, 4, 8, 16)), 1),
}


def _model(size: str, compiler: str | None, args):
    overrides, batch = SIZES[size]
    config = DilatedTransformerConfig.preset("small", vocab_size=256, **overrides)
    torch.manual_seed(0)
    model = DilatedTransformerLM(config).to(args.device, getattr(torch, args.dtype))
    if compiler is not None:
        for block in model.blocks:
            block.compile(backend=compiler)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), config.seq_len, batch


def step_times(size: str, args) -> dict[str, tuple[list[float], float]]:
    """Per side (eager, compiled): seconds of each step and the last loss. Both models are
    built from one seed and trained on the same batches, one step of each in turn (eager first
    on even steps), so a drift in the machine's speed falls on both; the first 3 steps of each are
    warm-ups (the compiled side's first compiles)."""
    torch._dynamo.reset()
    sides = {"eager": _model(size, None, args), "compiled": _model(size, args.compiler, args)}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, float] = {}
    for step in range(3 + args.steps):
        seq_len, batch = sides["eager"][2], sides["eager"][3]
        tokens = torch.randint(0, 256, (batch, seq_len), device=args.device,
                               generator=torch.Generator(args.device).manual_seed(step))
        for name in (("eager", "compiled") if step % 2 == 0 else ("compiled", "eager")):
            model, optimizer = sides[name][:2]
            sync()
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync()
            times[name].append(time.perf_counter() - start)
            losses[name] = loss.item()
    return {name: (times[name], losses[name]) for name in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float64"))
    parser.add_argument("--sizes", default="small,8k,32k", help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}, {args.dtype}, {args.steps} timed "
          "steps after 3 warm-ups")
    print("size   | eager ms median (min) | compiled ms median (min) | eager / compiled | compile s "
          "| loss eager, compiled")
    for size in args.sizes.split(","):
        runs = step_times(size, args)
        (eager, eager_loss), (compiled, compiled_loss) = runs["eager"], runs["compiled"]
        e, c = statistics.median(eager[3:]), statistics.median(compiled[3:])
        print(f"{size:6} | {e * 1e3:9.2f} ({min(eager[3:]) * 1e3:.2f}) | {c * 1e3:10.2f} "
              f"({min(compiled[3:]) * 1e3:.2f}) | {e / c:16.2f} | {compiled[0] - eager[0]:9.1f} "
              f"| {eager_loss:.4f}, {compiled_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
