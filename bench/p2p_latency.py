"""Point-to-point message latency of the in-memory engine, beside a plain thread handoff.

Ranks are threads of this process. Two patterns:
- pairs: ranks 2i and 2i+1 play ping-pong (send, then receive the reply), all pairs at once;
- ring: every rank posts a receive from rank - 1, sends to rank + 1 and waits (a ring attention
  or pipeline step's exchange).
The baseline is what a user would otherwise write between threads: the same tensor copied and
handed over through a ``queue.SimpleQueue`` per receiving thread, in the same pattern and run.
Messages are 4 KB (1024 float32), so the time is the engines' per-message cost, not the copy.

Each rank runs rounds // 10 untimed rounds, waits at a barrier, then times ``--rounds`` rounds;
the figure is the slowest rank's total time / rounds. The median of single rounds is printed
beside it, but is not a round's cost: in a ring a rank that runs late finds its message waiting,
so most of its rounds look short (before the twenty-fourth session the median was the figure,
and in a ring at world 8 it read 17 us where total / rounds was 172 us).

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


def _timed_rounds(exchange, barrier, rounds: int) -> tuple[float, float]:
    """(total time / rounds, median of single rounds) of ``rounds`` calls of ``exchange`` after
    ``rounds // 10`` untimed ones; every rank starts the timed rounds after ``barrier``."""
    for _ in range(rounds // 10):
        exchange()
    barrier()
    times = []
    start = time.perf_counter()
    for _ in range(rounds):
        began = time.perf_counter()
        exchange()
        times.append(time.perf_counter() - began)
    return (time.perf_counter() - start) / rounds, statistics.median(times)


def _exchange(pattern: str, send, recv, rank: int, world: int):
    """One round for ``rank``: a ping-pong round trip (pairs) or one ring step; ``recv`` posts a
    receive and returns what waits for it."""
    t = torch.zeros(NUMEL)
    if pattern == "pairs":
        other = rank ^ 1

        def round_trip():
            if rank % 2 == 0:
                send(t, other)
                recv(t, other)()
            else:
                recv(t, other)()
                send(t, other)
        return round_trip

    def ring_step():
        pending = recv(t, (rank - 1) % world)
        send(t, (rank + 1) % world)
        pending()
    return ring_step


def _summary(per_rank: list[tuple[float, float]]) -> tuple[float, float]:
    """(the slowest rank's total / rounds, the median over ranks of their median round)."""
    return max(r[0] for r in per_rank), statistics.median(r[1] for r in per_rank)


def engine(pattern: str, world: int, rounds: int) -> tuple[float, float]:
    def run(b):
        if pattern == "pairs":  # blocking send and recv, as a round trip is written
            send, recv = b.send, (lambda t, peer: lambda: b.recv(t, peer))
        else:  # post the receive, send on, wait
            send, recv = b.isend, (lambda t, peer: b.irecv(t, peer).wait)
        return _timed_rounds(_exchange(pattern, send, recv, b.rank, world), b.barrier, rounds)
    return _summary(spawn(run, world))


def handoff(pattern: str, world: int, rounds: int) -> tuple[float, float]:
    """The same pattern over one SimpleQueue per receiving thread (a copy per message)."""
    inboxes = [queue.SimpleQueue() for _ in range(world)]
    barrier = threading.Barrier(world)
    results = [(0.0, 0.0)] * world

    def run(rank):
        def send(t, peer):
            inboxes[peer].put(t.clone())

        def recv(t, peer):
            return lambda: t.copy_(inboxes[rank].get())
        results[rank] = _timed_rounds(_exchange(pattern, send, recv, rank, world), barrier.wait, rounds)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return _summary(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--rounds", type=int, default=1500, help="timed rounds per rank")
    args = parser.parse_args()
    print(f"command: python bench/p2p_latency.py --worlds {args.worlds} --rounds {args.rounds}")
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}, 4 KB messages; "
          "us per round = the slowest rank's total time / rounds from a common barrier; "
          "median round = the median over ranks of each rank's median single round (not a step's "
          "time: in a ring a late rank finds its message waiting)")
    print("| pattern | world | engine us per round | handoff us per round | engine / handoff "
          "| engine median round us | handoff median round us |")
    print("|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        for pattern in ("pairs", "ring"):
            if pattern == "pairs" and world % 2:
                continue
            (ours, ours_med), (theirs, theirs_med) = (engine(pattern, world, args.rounds),
                                                      handoff(pattern, world, args.rounds))
            print(f"| {pattern} | {world} | {ours * 1e6:.1f} | {theirs * 1e6:.1f} | {ours / theirs:.2f} "
                  f"| {ours_med * 1e6:.1f} | {theirs_med * 1e6:.1f} |", flush=True)

if __name__ == "__main__":
    main()
