"""Tensor parallelism: step time of the dilated-attention LM under TensorParallelModel (gloo,
tp = 2 processes, one thread each) against the dense model in one process, and the bytes each
rank hands to all_reduce per step against the Megatron count.

    python bench/tensor_parallel.py [--steps 6] [--layers 4] [--seq 256]

Megatron count: per transformer block, one all-reduce of the activation ``(B, T, E)`` after the
attention and one after the MLP in the forward pass, and the same two in the backward pass
(``2 * 2 * L`` all-reduces of ``B*T*E`` elements per step). distframe adds, by design, the
vocab-parallel embedding's forward all-reduce and the backward all-reduce in front of the
column-parallel head (each one activation), the MAGNETO sub-layer norm's two ``(B, T, 1)``
statistics per attention each way, one all_gather of the logits so that an unmodified loss_fn
sees the dense output; the loss is the same on every tensor rank, so train_step all-reduces it
over the data-parallel group only (none here: the prediction counted an 8-byte one until the
twentieth session, 8 bytes over what was measured). The table shows the
measured bytes beside that prediction. Step time: median over the timed steps (slowest rank).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

_BENCH = os.path.dirname(os.path.abspath(__file__))
# bench/ goes last on the path: bench/attention.py must not shadow the attention package.
sys.path[:] = [os.path.dirname(_BENCH)] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]

BATCH, EMBED, HEADS, VOCAB = 4, 256, 4, 256


def build(layers: int, seq: int):
    from attention.model import DilatedTransformerConfig, DilatedTransformerLM
    config = DilatedTransformerConfig(vocab_size=VOCAB, seq_len=seq, embed_dim=EMBED, num_heads=HEADS,
                                      num_layers=layers, segment_lengths=(seq // 4, seq // 2, seq),
                                      dilation_rates=(1, 2, 4))
    torch.manual_seed(0)
    return DilatedTransformerLM(config)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(step: int, seq: int):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, seq), generator=g),
            torch.randint(0, VOCAB, (BATCH, seq), generator=g))


def _tp_rank(backend, layers, seq, steps, warmup):
    from distframe.models.tensor_parallel_model import TensorParallelModel
    torch.set_num_threads(1)
    model = TensorParallelModel(build(layers, seq), backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, comm = [], None
    for s in range(warmup + steps):
        x, y = batch(s, seq)
        backend.barrier()
        backend.stats.reset()
        start = time.perf_counter()
        model.train_step((x, y), lm_loss, opt)
        times.append(time.perf_counter() - start)
        comm = (dict(backend.stats.calls), dict(backend.stats.bytes))
    return times[warmup:], comm


def dense_times(layers, seq, steps, warmup, threads):
    torch.set_num_threads(threads)
    model = build(layers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for s in range(warmup + steps):
        x, y = batch(s, seq)
        start = time.perf_counter()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def predicted_bytes(layers: int, seq: int, tp: int) -> dict[str, int]:
    activation = BATCH * seq * EMBED * 4
    statistic = BATCH * seq * 4
    return {
        "megatron_blocks": 2 * 2 * layers * activation,
        "embedding_and_head": 2 * activation,
        "sub_ln_statistics": 2 * 2 * layers * statistic,
        "loss": 0,  # averaged over the data-parallel group only: none at tp=2 alone
        "logits_all_gather_input": BATCH * seq * (VOCAB // tp) * 4,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    from distframe._process_launch import ProcessPool
    tp = 2
    with ProcessPool(tp, "gloo", timeout=600) as pool:
        per_rank = pool.run(_tp_rank, args.layers, args.seq, args.steps, args.warmup)
    tp_step = statistics.median(max(t) for t in zip(*(r[0] for r in per_rank)))
    dense1 = statistics.median(dense_times(args.layers, args.seq, args.steps, args.warmup, 1))
    dense2 = statistics.median(dense_times(args.layers, args.seq, args.steps, args.warmup, 2))
    calls, nbytes = per_rank[0][1]
    predicted = predicted_bytes(args.layers, args.seq, tp)
    print(f"\n## Tensor parallel LM: L={args.layers}, E={EMBED}, H={HEADS}, T={args.seq}, B={BATCH}, "
          f"V={VOCAB}, float32, AdamW")
    print("| configuration | step time (ms) |")
    print("|---|---|")
    print(f"| dense, 1 process, 1 thread | {dense1 * 1e3:.1f} |")
    print(f"| dense, 1 process, 2 threads | {dense2 * 1e3:.1f} |")
    print(f"| TensorParallelModel tp=2, gloo, 1 thread per rank | {tp_step * 1e3:.1f} |")
    # The baseline a user with these 2 cores would otherwise pick: the dense model on both threads.
    print(f"\ntp / dense (2 threads) time: {tp_step / dense2:.3f} (below 1: tp=2 faster); "
          f"tp / dense (1 thread) time: {tp_step / dense1:.3f}")
    print(f"\n## Communication per step and rank (tp=2): calls {calls}")
    expected_all_reduce = (predicted["megatron_blocks"] + predicted["embedding_and_head"]
                           + predicted["sub_ln_statistics"] + predicted["loss"])
    print("| quantity | bytes |")
    print("|---|---|")
    print(f"| Megatron count: 2 all-reduces x (B,T,E) x {args.layers} blocks x 2 passes | {predicted['megatron_blocks']:,} |")
    print(f"| + embedding forward, head-input backward (2 x (B,T,E)) | {predicted['embedding_and_head']:,} |")
    print(f"| + sub-LN statistics (4 x (B,T,1) per block) | {predicted['sub_ln_statistics']:,} |")
    print(f"| = predicted all_reduce bytes | {expected_all_reduce:,} |")
    print(f"| measured all_reduce bytes | {nbytes.get('all_reduce', 0):,} |")
    print(f"| measured / Megatron count | {nbytes.get('all_reduce', 0) / predicted['megatron_blocks']:.3f} |")
    print(f"| all_gather of the logits (input bytes) | {nbytes.get('all_gather', 0):,} "
          f"(predicted {predicted['logits_all_gather_input']:,}) |")


if __name__ == "__main__":
    main()
