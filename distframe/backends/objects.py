"""Byte strings over any backend (what torch.distributed's *_object_list calls do, without pickle):
a length first, then the bytes as a uint8 tensor. Callers encode their objects themselves (JSON,
safetensors), so nothing executable crosses between ranks.

A blob that is not bytes-like (bytes, bytearray, memoryview) is a TypeError on the rank that
passed it, and a RankFailedError naming that rank on the others: it still sends the length,
as ``BAD_BLOB``, so that no rank waits in the collective for its timeout. (A str or an int used
to fail on that rank alone, or to send made-up bytes: ``bytearray(5)`` is five zeros.)
"""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import RankFailedError

BAD_BLOB = -1  # the length a rank sends in place of a blob that is not bytes


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)


def _checked(blob: object, call: str) -> tuple[bytes | None, TypeError | None]:
    """``blob`` as bytes, or the TypeError that names what it is and what to pass."""
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return bytes(blob), None  # (a memoryview's bytes, whatever its item format)
    how = ("encode the text (text.encode())" if isinstance(blob, str) else
           "serialise the object first (json.dumps(obj).encode(), safetensors)")
    return None, TypeError(f"{call}: blob is {type(blob).__name__} {blob!r:.60}, not bytes; "
                           f"pass bytes: {how}")


def _peer_failed(rank: int, call: str) -> RankFailedError:
    return RankFailedError(rank, f"its {call} blob was not bytes (a TypeError there, naming it)")


def all_gather_bytes(backend: ICommunicationBackend, blob: bytes) -> list[bytes]:
    """Every rank's ``blob``, in rank order, on every rank (lengths may differ)."""
    checked, error = _checked(blob, "all_gather_bytes")
    raw = _as_tensor(checked) if error is None else torch.zeros(0, dtype=torch.uint8)
    length = raw.numel() if error is None else BAD_BLOB
    sizes = backend.all_gather(torch.tensor([length], dtype=torch.int64))
    if error is not None:
        raise error
    bad = (sizes == BAD_BLOB).nonzero()
    if bad.numel():
        raise _peer_failed(int(bad[0]), "all_gather_bytes")
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:raw.numel()] = raw
    rows = backend.all_gather(padded).view(backend.world_size, -1)
    return [rows[r, :int(sizes[r])].numpy().tobytes() for r in range(backend.world_size)]


def broadcast_bytes(backend: ICommunicationBackend, blob: bytes, src: int) -> bytes:
    """Rank ``src``'s ``blob`` on every rank (other ranks' ``blob`` is ignored, whatever it is)."""
    checked, error = _checked(blob, "broadcast_bytes") if backend.rank == src else (b"", None)
    size = torch.tensor([BAD_BLOB if error is not None else len(checked) if backend.rank == src
                         else 0], dtype=torch.int64)
    backend.broadcast(size, src)
    if error is not None:
        raise error
    if int(size) == BAD_BLOB:
        raise _peer_failed(src, "broadcast_bytes")
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if backend.rank == src and checked:
        buf.copy_(_as_tensor(checked))
    backend.broadcast(buf, src)
    return buf.numpy().tobytes()
