"""Argument checks shared by every engine: each error says what to change."""
from __future__ import annotations

import numbers
import operator

import torch

#: The longest timeout (seconds, about 3 years) an engine takes: torch's TCPStore fails past 1e9 s.
MAX_TIMEOUT = 1e8


def check_timeout(timeout: float) -> float:
    """``timeout`` as a float, or ValueError unless it is a real number (not a bool, a string or a
    timedelta) with 0 < timeout <= MAX_TIMEOUT (NaN included)."""
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        hint = "; for a timedelta pass its .total_seconds()" if hasattr(timeout, "total_seconds") else ""
        raise ValueError(f"timeout must be a number of seconds (an int or a float), got "
                         f"{type(timeout).__name__} {timeout!r}{hint}")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT:g}, "
                         f"got {timeout!r}")
    return float(timeout)


def check_wait_timeout(timeout: object) -> float | None:
    """A ``Work.wait`` timeout: None (the backend's own) or a number of seconds from 0 (look
    once) to MAX_TIMEOUT, as a float; else ValueError (a string gave a bare TypeError)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout <= MAX_TIMEOUT:
        raise ValueError(f"Work.wait: timeout must be None (the backend's timeout) or a number of "
                         f"seconds from 0 to {MAX_TIMEOUT:g}, got {type(timeout).__name__} {timeout!r}")
    return float(timeout)


def check_tensor(op: str, tensor: object, *, written: bool = False) -> torch.Tensor:
    """``tensor`` as the engines see it (:func:`plain`); TypeError if it is no tensor, ValueError
    if it holds no values in memory to move: every engine moves a strided tensor's memory, and a
    sparse tensor (no ``nbytes``, no contiguous form) or a meta tensor (no data; every one's
    data_ptr is 0, which the in-memory engine took for shared memory) failed deep in torch.
    ``written``: ``op`` writes into ``tensor`` (a receive, an in-place collective), so one whose
    elements share memory is refused too (:func:`has_internal_overlap`).
    Two attribute reads per call (about 0.1 us), on the hot path of every call."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not _STRIDED or tensor.is_meta:
        raise ValueError(_unmovable(op, tensor))
    if written and not tensor.is_contiguous() and has_internal_overlap(tensor):
        raise ValueError(f"{op} writes into its tensor, and this one has internal overlap (shape "
                         f"{tuple(tensor.shape)}, stride {tensor.stride()}: an expanded view, whose "
                         "elements share memory); pass a tensor without internal overlap, such as "
                         "t.clone() or t.contiguous(), and read the result from it")
    return plain(tensor)


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether elements of ``tensor`` share memory: a dim of size above 1 with stride 0 (an
    ``expand``ed view), the overlap torch itself refuses to write into. Such a tensor failed in
    the first wait of a receive, with torch's error, after its message had been taken."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


_STRIDED = torch.strided


def _unmovable(op: str, tensor: torch.Tensor) -> str:
    if tensor.is_meta:
        return (f"{op}: got a meta tensor, which has no data to send (only a shape and dtype); "
                "materialize it on cpu or cuda first (torch.empty_like(t, device='cpu'), or "
                "model.to_empty(device=...) for a model built on the meta device)")
    kind = "sparse tensor" if "sparse" in str(tensor.layout) else "tensor"
    return (f"{op}: got a {kind} of layout {tensor.layout}, and collectives and point-to-point "
            "calls move dense (strided) tensors: call .to_dense() first, or, to keep it sparse, "
            "all_gather its indices and values (dense tensors) and rebuild it on each rank")


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the engines see it: a detached alias when it requires grad. Collectives move
    data outside autograd, as torch.distributed's do (``functional`` has differentiable ones), so
    a parameter can be broadcast into in place, and in-memory ranks, which write into each other's
    tensors, never join their autograd graphs."""
    return tensor.detach() if tensor.requires_grad else tensor


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values in order: contiguous, and not a lazy negation
    or conjugation (torch's neg and conj bits: ``x.conj()``, and the ``.imag`` of one). Gloo and
    MPI move memory, so such a view sent 5 for -5, or failed in NumPy; torch ops (the in-memory
    engine) respect the bits."""
    return tensor.is_contiguous() and not tensor.is_neg() and not tensor.is_conj()


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when :func:`is_dense`, else a contiguous copy of its values (written back
    with ``copy_``, which respects the bits, where an op writes into it)."""
    return tensor if is_dense(tensor) else tensor.resolve_conj().resolve_neg().contiguous()


def as_int(op: str, name: str, value: object) -> int:
    """``value`` as a Python int: an int, or an integer that converts exactly (a NumPy integer,
    a 0-dim integer tensor), as torch.distributed takes them; never a bool or a float."""
    if value.__class__ is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{op}: {name} must be an int, got {value!r}; pass an integer rank or tag")


def check_peer(op: str, name: str, peer: object, world_size: int) -> int:
    """``peer`` as an int, or ValueError unless it is a rank of a group of ``world_size``."""
    peer = as_int(op, name, peer)
    if not 0 <= peer < world_size:
        raise ValueError(f"{op}: {name}={peer!r} is out of range for a group of world_size "
                         f"{world_size}; use a rank in 0..{world_size - 1}")
    return peer


def check_p2p(op: str, tensor: object, peer: object, tag: object, rank: int, world_size: int,
              tag_limit: int) -> tuple[torch.Tensor, int, int]:
    """(the tensor as the engines see it, the peer and the tag as ints)."""
    data = check_tensor(op, tensor, written="recv" in op)
    peer = check_peer(op, "dst" if "send" in op else "src", peer, world_size)
    if peer == rank:
        raise ValueError(f"{op}: rank {peer} is this rank; send to and receive from other ranks")
    tag = as_int(op, "tag", tag)
    if not 0 <= tag < tag_limit:
        raise ValueError(f"{op}: tag must be an int in 0..{tag_limit - 1}, got {tag!r}")
    return data, peer, tag


def check_out(op: str, out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``out`` as the engines write it (:func:`plain`: a detached alias when it requires grad)."""
    out = check_tensor(op, out)
    if out.shape != shape or out.dtype != like.dtype or not is_dense(out):
        kind = ("internally overlapping (an expanded view's elements share memory) "
                if has_internal_overlap(out) else "non-contiguous " if not out.is_contiguous() else
                "lazily negated or conjugated (neg or conj bit) " if not is_dense(out) else "")
        raise ValueError(f"{op}: out must be a contiguous {like.dtype} tensor of shape {tuple(shape)}, "
                         f"got {kind}{out.dtype} {tuple(out.shape)}")
    # Storages on different devices never share an address, and empty ones may both have none.
    ptr = _storage_address(out)
    if ptr and ptr == _storage_address(like):
        raise ValueError(f"{op}: out must not share storage with the input; pass a separate buffer")
    return out


def check_chunks(op: str, chunks: object, world_size: int, *, same_shape: bool) -> list[torch.Tensor]:
    if chunks is None or isinstance(chunks, torch.Tensor) or len(chunks) != world_size:
        raise ValueError(f"{op} needs a list of world_size={world_size} tensors, got {chunks!r:.80}")
    chunks = [dense(check_tensor(op, c)) for c in chunks]  # read only: values, in plain memory
    first = chunks[0]
    for j, c in enumerate(chunks):
        if not same_shape and c.dim() == 0:
            raise ValueError(f"{op}: chunk {j} is 0-dim, and chunks are split along dim 0; pass "
                             "t.reshape(1) for a single value")
        if c.dtype != first.dtype or (same_shape and c.shape != first.shape) or (
                not same_shape and c.shape[1:] != first.shape[1:]):
            what = "shape and dtype" if same_shape else "dtype and dims after dim 0"
            raise ValueError(f"{op}: chunk {j} has shape {tuple(c.shape)} and dtype {c.dtype}, "
                             f"chunk 0 has {tuple(first.shape)} and {first.dtype}; all chunks need one {what}")
    return chunks


def check_group_ranks(ranks: object, world_size: int) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"new_group needs a sequence of ranks, got {ranks!r}")
    ranks = list(ranks)
    if not ranks:
        raise ValueError("new_group needs at least one rank")
    ranks = [as_int("new_group", "each rank", r) for r in ranks]
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"new_group: unknown ranks {bad}; this group has ranks 0..{world_size - 1}")
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"new_group: ranks {dup} are listed more than once; list each rank once")
    return ranks


def _storage_address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage: ``untyped_storage().data_ptr()`` without building a
    storage object, which on a hot path cost microseconds per call (BENCHMARKS.md, MPI at 1 MB)."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
