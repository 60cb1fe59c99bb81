"""What a rank says it is calling: compared across ranks to turn a mismatch into an error.

The in-memory engine compares :class:`Signature` objects directly at every rendezvous. Engines
that live in separate processes compare the ranks of one node through shared memory
(``call_slots``), and every rank in ``debug=True`` mode, by all-gathering the fixed-length integer
encoding from :meth:`Signature.encode` before each collective: one extra small all-gather (a
latency, not a bandwidth cost) per call.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
       "all_to_all", "barrier", "new_group", "send", "recv")
# A dtype's code is its index here, the same in every process: append, never reorder.
# By name: a dtype this torch lacks (float8_e8m0fnu before 2.7) keeps its code, unused.
DTYPES = (None, *(getattr(torch, name, f"missing {name}") for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "complex32", "uint16", "uint32", "uint64", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")))
ENCODED_LENGTH = 16
_MAX_DIMS = 8


@dataclasses.dataclass(frozen=True)
class Signature:
    """The op, the tensor's shape and dtype, and op arguments that must agree (root, reduce op)."""

    op: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    args: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        parts = []
        if self.shape is not None:
            parts.append(f"shape={tuple(self.shape)}")
        if self.dtype is not None:
            parts.append(f"dtype={str(self.dtype).removeprefix('torch.')}")
        parts.extend(f"{k}={v}" for k, v in self.args)
        return f"{self.op}({', '.join(parts)})"

    def encode(self, seq: int) -> torch.Tensor:
        """A fixed-length int64 tensor; equal signatures at equal sequence numbers encode equally."""
        codes = [OPS.index(self.op), seq, DTYPES.index(self.dtype) if self.dtype in DTYPES else 99]
        shape = self.shape
        if shape is None:
            codes += [-1] + [-1] * _MAX_DIMS
        else:
            dims = list(shape[:_MAX_DIMS]) + [-1] * max(0, _MAX_DIMS - len(shape))
            if len(shape) > _MAX_DIMS:
                dims[-1] = _digest(shape[_MAX_DIMS - 1:])
            codes += [len(shape)] + dims
        codes.append(_digest(self.args))
        codes += [0] * (ENCODED_LENGTH - len(codes))
        return torch.tensor(codes[:ENCODED_LENGTH], dtype=torch.int64)

    @staticmethod
    def decode(codes: torch.Tensor) -> str:
        """A readable (partial) description of an encoded signature, for error messages."""
        values = [int(c) for c in codes.tolist()]
        op = OPS[values[0]] if 0 <= values[0] < len(OPS) else f"op#{values[0]}"
        dtype = DTYPES[values[2]] if 0 <= values[2] < len(DTYPES) else None
        ndim = values[3]
        parts = []
        if ndim >= 0:
            parts.append(f"shape={tuple(values[4:4 + min(ndim, _MAX_DIMS)])}")
        if dtype is not None:
            parts.append(f"dtype={str(dtype).removeprefix('torch.')}")
        parts.append(f"args#{values[4 + _MAX_DIMS] & 0xFFFF:04x}")
        return f"{op}({', '.join(parts)}) at sequence number {values[1]}"

    @staticmethod
    def decode_nbytes(codes: torch.Tensor) -> int | None:
        """The size in bytes of the tensor an encoded signature describes; None where the encoding
        does not tell (no shape, more than 8 dims, a dtype unknown here)."""
        values = [int(c) for c in codes.tolist()]
        dtype = DTYPES[values[2]] if 0 <= values[2] < len(DTYPES) else None
        dims = values[4:4 + values[3]]
        if not isinstance(dtype, torch.dtype) or not 0 <= values[3] <= _MAX_DIMS or min(dims, default=0) < 0:
            return None
        return math.prod(dims) * dtype.itemsize


def _digest(value: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def describe_mismatch(signatures: dict[int, str]) -> str:
    """Group ranks by what they called: 'ranks [0, 2] called X; rank 1 called Y'."""
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(signatures.items()):
        groups.setdefault(text, []).append(rank)
    text = "; ".join(f"rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]} called {text}"
                     for text, r in groups.items())
    if "args#" in text:  # another process's arguments, known here only by their digest
        text += (" (args#...: arguments this process has not used itself, such as another root "
                 "or reduce op, or the autograd pass of a distframe.backends.functional call: a rank "
                 "whose input required grad where the others' did not, or that ran a backward the "
                 "others did not)")
    return text
