"""ParallelDims: how ``dp x tp x pp x cp`` degrees lay ranks out, and the named subgroups it builds.

The layout is Megatron's and torchtitan's, tensor parallelism varying fastest, then context
(sequence) parallelism, data parallelism, and pipeline slowest:
``rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index``. Ranks of one
tensor-parallel group are neighbours (they talk every layer); ranks of one pipeline group are
``dp * cp * tp`` apart. With ``cp == 1`` this is the ``dp x tp x pp`` layout.

Ranks that hold the same parameters (same tensor and pipeline index) form a *replica* group of
``dp * cp`` ranks, ordered by ``dp_index * cp + cp_index``: gradients are averaged over it (a
context-parallel rank saw a slice of the sequence, a data-parallel one a slice of the batch).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError

AXES = ("dp", "tp", "pp", "cp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """This rank's subgroups (each a backend whose ranks are the axis index) and coordinates."""

    dims: ParallelDims
    world: ICommunicationBackend
    dp: ICommunicationBackend
    tp: ICommunicationBackend
    pp: ICommunicationBackend
    cp: ICommunicationBackend | None = None
    """The context-parallel group; None when ``dims.cp == 1`` (no group is built)."""
    replicas: ICommunicationBackend | None = None
    """The ``dp * cp`` ranks holding the same parameters (the dp group itself when cp == 1)."""

    def __post_init__(self) -> None:
        if self.replicas is None:
            object.__setattr__(self, "replicas", self.dp)

    @property
    def dp_index(self) -> int:
        return self.dp.rank

    @property
    def cp_index(self) -> int:
        return self.cp.rank if self.cp is not None else 0

    @property
    def replica_index(self) -> int:
        return self.replicas.rank

    @property
    def tp_index(self) -> int:
        return self.tp.rank

    @property
    def pp_index(self) -> int:
        return self.pp.rank


def inferred_degree(world: int, axis: str, **others: int) -> int:
    """The degree of ``axis`` that makes its product with ``others`` (the other degrees, by
    flag name) the world size; ConfigError if their product does not divide it (no value of
    ``--axis`` would then fit)."""
    divisor = math.prod(others.values())
    if world % divisor:
        given = " x ".join(f"--{name} {degree}" for name, degree in others.items())
        raise ConfigError(f"cannot infer --{axis}: {given} = {divisor} does not divide the world "
                          f"size {world}; choose degrees whose product divides {world}, or a world "
                          f"size that is a multiple of {divisor}")
    return world // divisor


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (``dp``), tensor (``tp``), pipeline (``pp``) and context (``cp``:
    the sequence split across ranks, attention as ``RingDilatedAttention``) parallelism.

    ``ParallelDims(dp, tp, pp, cp)`` validates that each degree is a positive int;
    ``validate(world_size)`` that their product is the world size. ``build_groups(backend)``
    is collective on ``backend`` (every rank calls ``new_group`` once per group of every axis,
    in the same order) and returns this rank's :class:`ParallelGroups`.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelDims.{axis}={value!r}: use a positive int (1 turns "
                                  f"{axis} parallelism off)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def validate(self, world_size: int) -> None:
        """ConfigError unless ``dp * tp * pp * cp == world_size``."""
        if self.world_size != world_size:
            raise ConfigError(
                f"ParallelDims(dp={self.dp}, tp={self.tp}, pp={self.pp}, cp={self.cp}) needs "
                f"dp*tp*pp*cp = {self.world_size} ranks but the backend has {world_size}; change "
                f"the degrees so that their product is {world_size}")

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """The global rank at these coordinates."""
        for axis, index in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
            if not 0 <= index < getattr(self, axis):
                raise ConfigError(f"{axis} index {index} is outside 0..{getattr(self, axis) - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"dp": ..., "tp": ..., "pp": ..., "cp": ...}`` of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside 0..{self.world_size - 1}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return {"dp": rest % self.dp, "tp": tp, "pp": rest // self.dp, "cp": cp}

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` as a list of global ranks ordered by that axis' index;
        ``"replicas"``: the ranks with equal tensor and pipeline index, ordered by
        ``dp_index * cp + cp_index``."""
        if axis == "replicas":
            return sorted([self.rank_of(dp=d, cp=c, tp=t, pp=p) for d in range(self.dp) for c in range(self.cp)]
                          for t in range(self.tp) for p in range(self.pp))
        if axis not in AXES:
            raise ConfigError(f"unknown axis {axis!r}; choose one of {AXES}")
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in others)):
            coords = dict(zip(others, fixed))
            groups.append([self.rank_of(**coords, **{axis: k}) for k in range(getattr(self, axis))])
        return sorted(groups)

    def build_groups(self, backend: ICommunicationBackend) -> ParallelGroups:
        """This rank's dp, tp and pp subgroups, and with cp > 1 its cp and replica groups;
        collective on ``backend`` (the whole world)."""
        self.validate(backend.world_size)
        mine = {}
        for axis in (*AXES, "replicas") if self.cp_enabled else ("dp", "tp", "pp"):
            for ranks in self.group_ranks(axis):
                group = _subgroup(backend, ranks)
                if group is not None:
                    mine[axis] = group
        return ParallelGroups(dims=self, world=backend, **mine)


def _subgroup(backend: ICommunicationBackend, ranks: Sequence[int]) -> ICommunicationBackend | None:
    # A group of the whole world in order is the world itself; a one-rank group needs no peers
    # but is still created so every rank makes the same sequence of new_group calls.
    if list(ranks) == list(range(backend.world_size)):
        return backend
    return backend.new_group(list(ranks))
