"""Making replicas agree at construction: a structure check and a broadcast from rank 0.

check_same_structure: one all_gather of a fingerprint per parameter and buffer (plus, only when
they differ, one all_gather of the descriptions) so every rank raises the same ConfigError.
broadcast_module_state: one broadcast per dtype of all parameters and buffers, flattened.
broadcast_tensors: the same for any tensors (the buffers DDP-style strategies re-broadcast); a
tensor that already holds rank 0's values is not written.
check_unwrapped, mark_wrapped: a module is wrapped once (no communication); check_initialised: no
lazy parameter is left uninitialised.
"""
from __future__ import annotations

import hashlib
import itertools

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError

_DESCRIPTION_BYTES = 200
_WRAPPED_BY = "_distframe_wrapped_by"


def check_unwrapped(module: nn.Module, strategy: str) -> None:
    """ConfigError if ``module``, or a submodule, was wrapped before (``mark_wrapped``). A wrapper
    changes the module's parameters in place (gradient hooks; under ZeRO-3 and FSDP, views of
    storage freed between uses, which torch reads as garbage or crashes on), so a second wrapper
    would run the first one's hooks, or read freed storage."""
    for name, sub in module.named_modules():
        earlier = sub.__dict__.get(_WRAPPED_BY)
        if earlier is not None:
            which = f"its submodule '{name}'" if name else "it"
            raise ConfigError(
                f"{strategy} cannot wrap this module: {which} was wrapped by {earlier} already, which "
                "hooked its parameters (ZeRO-3 and FSDP also replace their storage); build a fresh "
                "module for each wrapper (or copy.deepcopy it before the first wrap)")


def check_initialised(module: nn.Module, strategy: str) -> None:
    """ConfigError for a lazy module's parameter or buffer not yet initialised (``nn.LazyLinear``
    before its first forward): its shape, which the structure check, the broadcast and every
    strategy's buckets and shards are laid out from, is not known yet."""
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if is_lazy(tensor):
            raise ConfigError(
                f"{strategy} cannot wrap a model whose {name!r} is an uninitialised lazy parameter "
                "(nn.LazyLinear and the other Lazy modules learn their shapes at the first forward); "
                "run one forward on a sample batch before wrapping, as torch DDP asks")


def mark_wrapped(module: nn.Module, strategy: str) -> None:
    """Called by a strategy once its checks have passed, before it changes ``module``: a failed
    check leaves the module as it was, free to be wrapped again once fixed."""
    module.__dict__[_WRAPPED_BY] = strategy


def describe_entries(module: nn.Module) -> list[str]:
    """'kind name shape dtype' for every parameter then every buffer, in registration order."""
    entries = [f"parameter {n} {tuple(p.shape)} {p.dtype}" for n, p in module.named_parameters()]
    entries += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    return entries


def fingerprint(text: str) -> int:
    """56 bits of ``text``'s hash, the same in every process (Python's hash() is salted per
    process, which breaks multi-process engines); fits an int64 tensor."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def check_same_structure(module: nn.Module, backend: ICommunicationBackend) -> None:
    """Raises ConfigError on every rank unless all ranks wrap the same parameter and buffer
    names, shapes and dtypes; the message names the first differing entry and the ranks."""
    entries = describe_entries(module)
    count = torch.tensor([len(entries)], dtype=torch.int64)
    counts = backend.all_gather(count)
    longest = int(counts.max())
    prints = torch.full((longest + 1,), -1, dtype=torch.int64)
    prints[:len(entries)] = torch.tensor([fingerprint(e) for e in entries], dtype=torch.int64)
    table = backend.all_gather(prints).view(backend.world_size, -1)
    differs = (table != table[0]).any(dim=0)
    if not bool(differs.any()):
        return
    index = int(differs.nonzero()[0])
    mine = entries[index] if index < len(entries) else "nothing (fewer parameters and buffers)"
    encoded = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    raw = mine.encode()[:_DESCRIPTION_BYTES]
    encoded[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    texts = backend.all_gather(encoded).view(backend.world_size, -1)
    decoded = [bytes(texts[r].tolist()).rstrip(b"\0").decode(errors="replace")
               for r in range(backend.world_size)]
    odd = [r for r in range(backend.world_size) if int(table[r, index]) != int(table[0, index])]
    raise ConfigError(
        f"ranks wrap different models: entry #{index} is {decoded[0]} on rank 0 but "
        f"{decoded[odd[0]]} on rank(s) {odd}; build the same model (same names, shapes and "
        "dtypes) on every rank before wrapping it")


def broadcast_module_state(module: nn.Module, backend: ICommunicationBackend, src: int = 0) -> None:
    """Copies rank ``src``'s parameters and buffers into every rank's module, in place."""
    broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), backend, src)


def broadcast_tensors(tensors: list[torch.Tensor], backend: ICommunicationBackend, src: int = 0) -> None:
    """Copies rank ``src``'s ``tensors`` into every rank's, in place (those that differ): one
    broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group]) if group else torch.empty(0, dtype=dtype)
        backend.broadcast(flat, src)
        received, offset = [], 0
        for t in group:
            received.append(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        # A tensor equal already (rank src's own; a buffer no step changed) is not written, so a
        # buffer a forward saved for its backward (x * self.scale) keeps its autograd version.
        # One device-to-host read per dtype, not one per tensor.
        differs = torch.stack([(t != r).any() for t, r in zip(group, received)]).tolist() if group else []
        for t, r, changed in zip(group, received, differs):
            if changed:
                t.copy_(r)
