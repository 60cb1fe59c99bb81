"""Point-to-point message latency of the in-memory engine, beside a plain thread handoff.

Ranks are threads of this process. Two patterns, median over rounds after a warm-up:
- pairs: ranks 2i and 2i+1 play ping-pong (send, then receive the reply), all pairs at once;
- ring: every rank posts a receive from rank - 1, sends to rank + 1 and waits (a ring attention
  or pipeline step's exchange).
The baseline is what a user would otherwise write between threads: the same tensor copied and
handed over through a ``queue.SimpleQueue`` per receiving thread, in the same pattern and run.
Messages are 4 KB (1024 float32), so the time is the engines' per-message cost, not the copy.

    python bench/p2p_latency.py [--worlds 2,4,8] [--rounds 1500]
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time

import torch

# Run as a script, this folder comes first on sys.path, where bench/attention.py would shadow the
# attention package: the repository goes first and this folder is dropped.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH)] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

from distframe.launch import spawn  # noqa: E402

NUMEL = 1024


def _pairs_rank(send, recv, rank: int, rounds: int) -> float:
    t = torch.zeros(NUMEL)
    other, times = rank ^ 1, []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank % 2 == 0:
            send(t, other)
            recv(t, other)
        else:
            recv(t, other)
            send(t, other)
        times.append(time.perf_counter() - start)
    return statistics.median(times[rounds // 10:])


def _ring_rank(isend, irecv, rank: int, world: int, rounds: int) -> float:
    t, times = torch.zeros(NUMEL), []
    for _ in range(rounds):
        start = time.perf_counter()
        pending = irecv(t, (rank - 1) % world)
        isend(t, (rank + 1) % world)
        pending()
        times.append(time.perf_counter() - start)
    return statistics.median(times[rounds // 10:])


def engine(pattern: str, world: int, rounds: int) -> float:
    def run(b):
        if pattern == "pairs":
            return _pairs_rank(lambda t, p: b.send(t, p), lambda t, p: b.recv(t, p), b.rank, rounds)
        return _ring_rank(lambda t, p: b.isend(t, p), lambda t, p: b.irecv(t, p).wait, b.rank, world, rounds)
    return statistics.median(spawn(run, world))


def handoff(pattern: str, world: int, rounds: int) -> float:
    """The same pattern over one SimpleQueue per receiving thread (a copy per message)."""
    inboxes = [queue.SimpleQueue() for _ in range(world)]
    results = [0.0] * world

    def send(rank):
        return lambda t, peer: inboxes[peer].put(t.clone())

    def recv(rank):
        return lambda t, peer: t.copy_(inboxes[rank].get())

    def run(rank):
        if pattern == "pairs":
            results[rank] = _pairs_rank(send(rank), recv(rank), rank, rounds)
        else:
            results[rank] = _ring_rank(send(rank), lambda t, peer: (lambda: recv(rank)(t, peer)),
                                       rank, world, rounds)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=1500)
    args = parser.parse_args()
    print(f"command: python bench/p2p_latency.py --worlds {args.worlds} --rounds {args.rounds}")
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}, 4 KB messages")
    print("| pattern | world | in-memory engine us | thread handoff us | engine / handoff |")
    print("|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        for pattern in ("pairs", "ring"):
            if pattern == "pairs" and world % 2:
                continue
            ours, theirs = engine(pattern, world, args.rounds), handoff(pattern, world, args.rounds)
            print(f"| {pattern} | {world} | {ours * 1e6:.1f} | {theirs * 1e6:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
