"""CUDA streams at the edges of a call that another thread carries out.

[Note: the caller's stream] torch.distributed orders a collective after the work its caller
queued on the current CUDA stream, and the caller's later work (after the call returns, or after
``Work.wait()``) after the collective's writes. Where an engine's own thread touches the
tensors, that thread's current stream is not the caller's (streams are current per thread), so
without care a user's ``with torch.cuda.stream(s):`` around training, or a hook that runs on a
side stream, let a collective read gradients before they were written, or the caller read
results before they arrived: ZeRO-1 over Gloo on a GPU ended 0.55 off one process, ZeRO-2 over
MPI 55. Two places carry the caller's stream:
- A call with ``async_op=True`` runs on the communication thread under the stream that was the
  caller's when it issued the call (``caller_stream``/``run_on``), so its reads are queued after
  the caller's work, and the thread waits for an event recorded after its own work before the
  call's Work completes: a waiter on any stream then reads finished results, and later work the
  caller queued on that stream is not waited for.
- In-memory ranks are threads reading and writing each other's tensors, each on its own current
  stream: a rank waits for its stream before it arrives (its inputs are written) and before it
  departs (what it wrote into its peers' tensors is there), and a result one rank computes for
  all is waited for before the others read it (``settle``).
Host waits, not stream-to-stream events: the Gloo and MPI engines stage CUDA tensors through host
memory, which waits anyway, the NCCL engine's wait polls for completion to keep its timeout, and
the in-memory engine is for tests. Each function asks ``torch.cuda.is_initialized()`` first
(as the autograd-thread check in ``rendezvous`` does), so a process that has not used CUDA, on
any machine, runs no other CUDA call here and pays one check: the engines stay device-agnostic
(STYLE.md, rule 5) for every device but the one whose streams torch.distributed orders this way.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def caller_stream() -> torch.cuda.Stream | None:
    """The calling thread's current stream on its current CUDA device; None without CUDA."""
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None


def run_on(stream: torch.cuda.Stream, fn: Callable[[Any], Any], call: Any) -> Any:
    """``fn(call)`` with ``stream`` current, returning once the work it queued there is done."""
    with torch.cuda.stream(stream):
        result = fn(call)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return result


def cuda_devices(payload: Any) -> set[int]:
    """The CUDA devices of the tensors in ``payload`` (a tensor, or a list or tuple of them)."""
    items = payload if isinstance(payload, (list, tuple)) else [payload]
    return {t.device.index for t in items if isinstance(t, torch.Tensor) and t.is_cuda}


def settle(payload: Any) -> Any:
    """Waits for the calling thread's current stream on each CUDA device of ``payload``;
    returns ``payload``."""
    if torch.cuda.is_initialized():
        for index in cuda_devices(payload):
            torch.cuda.current_stream(index).synchronize()
    return payload
