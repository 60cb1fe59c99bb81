"""Complex tensors in the shard files, which safetensors cannot hold: it has no complex dtypes
(a save of a complex parameter failed with ``KeyError: torch.complex128``).

A complex tensor is stored as its real view (``torch.view_as_real``: one more dimension, of the
real and imaginary parts), and the file's own string metadata lists the keys stored so, under
``"complex"`` (a JSON list), so the file says what it holds and the file's sha256 covers that
too. A reader turns them back (``torch.view_as_complex`` of a copy): whole, or sliced along the
first dimension, which is the piece's elements in both forms. The file tables' element counts
stay the complex tensors' own, so ranges of a parameter read alike whatever its dtype.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

COMPLEX = "complex"


def stored_form(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``tensors`` as safetensors can save them (contiguous; complex ones as their real view),
    and the file metadata that lists the complex ones (None when there are none)."""
    complex_keys = sorted(key for key, value in tensors.items() if value.is_complex())
    stored = {key: (torch.view_as_real(value.resolve_conj()) if value.is_complex() else value).contiguous()
              for key, value in tensors.items()}
    return stored, {COMPLEX: json.dumps(complex_keys)} if complex_keys else None


def complex_keys(handle: Any) -> set[str]:
    """The keys a shard file (a ``safe_open`` handle) stores as real views of complex tensors."""
    return set(json.loads((handle.metadata() or {}).get(COMPLEX, "[]")))


def restored(tensor: torch.Tensor, is_complex: bool) -> torch.Tensor:
    """A tensor (or a slice along its first dimension) as read from a file, complex again where
    it was stored as a real view."""
    # A copy first: safetensors aligns its data to 8 bytes only, and torch's complex128 kernels
    # read a view of such memory out of alignment (a copy_ from it crashed the process).
    return torch.view_as_complex(tensor.clone()) if is_complex else tensor


def restored_shape(shape: list[int], is_complex: bool) -> list[int]:
    """The shape of the tensor a stored one of ``shape`` stands for."""
    return list(shape[:-1]) if is_complex else list(shape)
