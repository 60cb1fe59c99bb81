"""Buffers (BatchNorm's running statistics) kept as rank 0's on every data-parallel replica, with
``ShardingConfig.broadcast_buffers``.

[Note: buffers after a step]
torch DDP broadcasts rank 0's buffers in the first forward after one that synchronised, in any
grad mode, so an evaluation after a step computes with rank 0's statistics on every rank (as the
checkpoint and ``gather_full_parameters()`` hold them); but it is then a collective, and an
evaluation on rank 0 alone waits for its peers. Here rank 0's buffers are received where every
rank is in step already, at the end of each gradient synchronisation (``after_step``: a strategy's
ParameterUsage reports that end, after the last bucket or unit, deferred with them; hybrid models
call it from ``synchronize_gradients``), and take effect without communication at the next
forward, of any kind, or read (``take_arrived``). Not at once: a second backward over the same
forward (``retain_graph=True``) reads the buffers its forward saved, and a write since would fail
torch's version check. A buffer written meanwhile (a load, ``reset_running_stats()``) keeps what
was written. A forward without grad sends nothing, so ``if rank == 0: evaluate(model)`` works.

Only a forward with grad in training mode is taken to change buffers (every rank runs those, so
the flag below stays the same on every rank; an evaluation, with grad or not, leaves it): after
one, the next synchronisation sends them, and the next forward that will synchronise gradients
broadcasts them first, as it did before every such forward (a forward without a backward,
no_sync's micro-steps). Otherwise nothing is sent twice.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.models.parameter_usage import ParameterUsage
from distframe.models.replicas import broadcast_tensors

BufferListing = Callable[[], tuple[list[torch.Tensor], ICommunicationBackend]]


class ReplicaBuffers:
    """``listing()`` gives the buffers (listed per call: module.to() replaces them) and the group
    whose rank 0 they follow; ``enabled``: ``broadcast_buffers``."""

    def __init__(self, listing: BufferListing, enabled: bool) -> None:
        self.listing = listing
        self.enabled = enabled
        self.agree = True  # every rank holds rank 0's (wrapping broadcast them); see the note
        self._arrived: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def _active(self) -> tuple[list[torch.Tensor], ICommunicationBackend] | None:
        buffers, group = self.listing()
        return (buffers, group) if self.enabled and group.world_size > 1 and buffers else None

    def broadcast(self) -> None:
        """Rank 0's buffers into every rank's now; collective."""
        if active := self._active():
            broadcast_tensors(*active)
        self.agree, self._arrived = True, []

    def after_step(self) -> None:
        """Receives rank 0's buffers, unless no forward changed them since they were last sent;
        they take effect at ``take_arrived``. Collective."""
        active = None if self.agree else self._active()
        if active is None:
            return
        buffers, group = active
        received = [b.detach().clone() for b in buffers]
        broadcast_tensors(received, group)
        self.agree = True
        if group.rank != 0:  # rank 0's are its own
            self._arrived = [(b, r, b._version) for b, r in zip(buffers, received)]

    def take_arrived(self) -> None:
        """Puts rank 0's buffers received by ``after_step`` in place, each unless written since."""
        arrived, self._arrived = self._arrived, []
        live = {id(b) for b in self.listing()[0]} if arrived else set()
        with torch.no_grad():
            for buffer, received, version in arrived:
                if id(buffer) in live and buffer._version == version:
                    buffer.copy_(received)

    def before_forward(self, synchronize: bool, training: bool) -> None:
        """Before a forward: arrived buffers in place; with grad, a broadcast first if this
        forward will synchronise and a forward changed them since they were sent (the note)."""
        self.take_arrived()
        if torch.is_grad_enabled():
            if synchronize and not self.agree:
                self.broadcast()
            if training:
                self.agree = False


class UsageThenBuffers(ParameterUsage):
    """A strategy's ParameterUsage, whose ``finish`` ends each gradient synchronisation on every
    rank alike (GradientBuckets, UnitLifecycle): ``then`` (``ReplicaBuffers.after_step``) follows."""

    def __init__(self, *args: Any, then: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.then = then

    def finish(self, started: Any) -> None:
        super().finish(started)
        self.then()
