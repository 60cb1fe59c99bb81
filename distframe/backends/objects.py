"""Byte strings over any backend (what torch.distributed's *_object_list calls do, without pickle):
a length first, then the bytes as a uint8 tensor. Callers encode their objects themselves (JSON,
safetensors), so nothing executable crosses between ranks."""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)


def all_gather_bytes(backend: ICommunicationBackend, blob: bytes) -> list[bytes]:
    """Every rank's ``blob``, in rank order, on every rank (lengths may differ)."""
    raw = _as_tensor(blob)
    sizes = backend.all_gather(torch.tensor([raw.numel()], dtype=torch.int64))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:raw.numel()] = raw
    rows = backend.all_gather(padded).view(backend.world_size, -1)
    return [rows[r, :int(sizes[r])].numpy().tobytes() for r in range(backend.world_size)]


def broadcast_bytes(backend: ICommunicationBackend, blob: bytes, src: int) -> bytes:
    """Rank ``src``'s ``blob`` on every rank (other ranks' ``blob`` is ignored)."""
    size = torch.tensor([len(blob) if backend.rank == src else 0], dtype=torch.int64)
    backend.broadcast(size, src)
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if backend.rank == src and blob:
        buf.copy_(_as_tensor(blob))
    backend.broadcast(buf, src)
    return buf.numpy().tobytes()
