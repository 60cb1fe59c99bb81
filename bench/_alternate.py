"""Times an engine call against the raw call it wraps, alternately, in the same processes (used by
_gloo_collectives.py and _mpi_collectives.py).

Two ways, both reported:
- one call after a barrier, engine and raw alternating (engine first on even repeats): the
  latency of a single call whose code has gone cold. A raw call is C all the way, an engine call
  runs Python first, which after a 1 MB transfer has evicted the caches costs several times its
  warm time (BENCHMARKS.md, issue 2);
- ``BLOCK`` calls back to back after a barrier, per call (nccl-tests' convention, and what a
  training loop that issues one collective after another sees), engine and raw blocks alternating.

A repeat's or block's time is its slowest rank's (``max_over_ranks``); the figures are medians,
and ``paired_ratio`` is the median over repeats of the engine's time over the raw call's in the
same repeat.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

BLOCK = 10


def time_alternately(barrier: Callable[[], None], max_over_ranks: Callable[[np.ndarray], None],
                     engine_call: Callable[[], object], raw_call: Callable[[], object],
                     repeats: int) -> dict:
    for call in (engine_call, raw_call, engine_call, raw_call):  # warm up both
        call()
    single = _alternate(barrier, engine_call, raw_call, repeats, 1)
    blocks = _alternate(barrier, engine_call, raw_call, max(5, repeats // BLOCK), BLOCK)
    max_over_ranks(single)
    max_over_ranks(blocks)
    return {"median_s": statistics.median(single[:, 0].tolist()),
            "raw_median_s": statistics.median(single[:, 1].tolist()),
            "paired_ratio": statistics.median((single[:, 0] / single[:, 1]).tolist()),
            "block_median_s": statistics.median(blocks[:, 0].tolist()),
            "block_raw_median_s": statistics.median(blocks[:, 1].tolist())}


def _alternate(barrier, engine_call, raw_call, repeats: int, per_repeat: int) -> np.ndarray:
    calls = (engine_call, raw_call)
    times = np.zeros((repeats, 2))
    for i in range(repeats):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            call = calls[which]
            barrier()
            start = time.perf_counter()
            for _ in range(per_repeat):
                call()
            times[i, which] = (time.perf_counter() - start) / per_repeat
    return times
