"""ICommunicationBackend: the one interface strategies program against."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from distframe.backends.types import CommStats, ReduceOp, Work


@runtime_checkable
class ICommunicationBackend(Protocol):
    """A group of ``world_size`` ranks; this object is rank ``rank`` of it.

    Names and argument order follow torch.distributed. Every collective must be called by every
    rank of the group in the same order; each accepts ``async_op=True`` and then returns a
    :class:`Work` whose ``wait()`` returns the result. ``new_group`` is called by every rank of
    the parent; the subgroup it returns is a backend in its own right.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    stats: CommStats

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                   async_op: bool = False) -> torch.Tensor | Work: ...

    def all_gather(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None,
                   async_op: bool = False) -> torch.Tensor | Work: ...

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                       out: torch.Tensor | None = None, async_op: bool = False) -> torch.Tensor | Work: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> torch.Tensor | Work: ...

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp | str = ReduceOp.SUM, *,
               async_op: bool = False) -> torch.Tensor | Work: ...

    def gather(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False
               ) -> list[torch.Tensor] | None | Work: ...

    def scatter(self, chunks: Sequence[torch.Tensor] | None, src: int, *,
                async_op: bool = False) -> torch.Tensor | Work: ...

    def all_to_all(self, chunks: Sequence[torch.Tensor], *, async_op: bool = False
                   ) -> list[torch.Tensor] | Work: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor: ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work: ...

    def barrier(self, *, async_op: bool = False) -> None | Work: ...

    def new_group(self, ranks: Sequence[int]) -> ICommunicationBackend | None: ...

    def shutdown(self) -> None: ...
