"""Dropout under tensor parallelism: which ranks draw the same mask (Megatron's RNG tracker).

[Note: dropout and the tensor group]
An activation outside the parallel region (the residual stream after a row-parallel layer's
all-reduce, the MLP's output) is computed identically on every rank of the tensor group, and so
must its dropout mask be: a mask drawn differently per rank makes the ranks' replicated
activations, then the gradients and values of their replicated parameters (layer norms, a row
layer's bias, positions), diverge, silently. Torch's global generator cannot give that: in-memory
ranks are threads sharing it (their draws interleave, so the run is not even reproducible) and
process ranks are seeded by the user. So each rank holds a TensorParallelRNG with two seeds
derived from one base seed that construction agrees on (world rank 0's, broadcast):

* ``replicated``: equal across the tensor group, different for every data-parallel (and context)
  replica and pipeline stage. Every ``nn.Dropout`` of a tensor-parallel model becomes a
  ReplicatedDropout drawing from it; the tensor ranks run the same forwards in the same order, so
  their generators advance in lockstep and the masks are bitwise equal. (A dropout a user's plan
  puts on a split activation, between a column and a row layer, draws the same mask on each
  rank's slice: consistent, though the slices' masks repeat one another.)
* ``split``: different on every rank; for dropout inside the parallel region, where each rank
  holds its own part of the activation (the attention probabilities of its heads).

The generators are made on first use for each device (``torch.Generator(device=...)``). They are
not part of the model's state dict; ``distframe.checkpoint`` saves each rank's ``state_dict()``
(the seeds and every generator's state) and restores it into the same layout, so a run resumed
from a checkpoint draws the masks the uninterrupted run would have drawn.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from attention.autograd_path import generator_dropout
from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.mesh import ParallelGroups
from distframe.models.replaced_modules import refuse_hooked

_SEED_BITS = 63  # torch.Generator.manual_seed takes a signed 64-bit seed: stay positive


def derive_seed(base: int, *coordinates: object) -> int:
    """A seed for ``coordinates`` (a region name and rank indices) that is the same in every
    process (``hash()`` is salted per process) and unrelated for neighbouring coordinates."""
    digest = hashlib.blake2b(repr((base, *coordinates)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << _SEED_BITS)


def agree_on_seed(seed: int | None, backend: ICommunicationBackend, device: torch.device) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()`` when None, as rank 0 has it, on every rank of
    ``backend`` (one broadcast of an int64)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"dropout_seed={seed!r}: use an int, or None for torch.initial_seed()")
    value = torch.initial_seed() if seed is None else seed
    agreed = torch.tensor([value % (1 << _SEED_BITS)], dtype=torch.int64, device=device)
    if backend.world_size > 1:
        backend.broadcast(agreed, 0)
    return int(agreed.item())


class TensorParallelRNG:
    """This rank's two dropout generators (see the module note): ``replicated_generator(device)``
    is seeded alike across the tensor group, ``split_generator(device)`` per tensor rank."""

    def __init__(self, replicated_seed: int, split_seed: int) -> None:
        self.replicated_seed, self.split_seed = replicated_seed, split_seed
        self._generators: dict[tuple[str, str], torch.Generator] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # "<region>.<device type>" -> generator state

    @classmethod
    def for_groups(cls, base_seed: int, groups: ParallelGroups) -> TensorParallelRNG:
        """Seeds for this rank's coordinates: ``replicated`` from (pipeline stage, replica index),
        ``split`` from those and the tensor index."""
        where = (groups.pp_index, groups.replica_index)
        return cls(derive_seed(base_seed, "replicated", *where),
                   derive_seed(base_seed, "split", *where, groups.tp_index))

    def replicated_generator(self, device: torch.device) -> torch.Generator:
        return self._generator("replicated", device)

    def split_generator(self, device: torch.device) -> torch.Generator:
        return self._generator("split", device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``seeds`` (int64: replicated, split) and the state of every generator drawn from so
        far, keyed ``<region>.<device type>`` (a rank draws on one device), on the CPU; a loaded
        state no generator has taken up yet counts as that generator's."""
        state = {"seeds": torch.tensor([self.replicated_seed, self.split_seed], dtype=torch.int64),
                 **self._loaded}
        for (region, device), generator in self._generators.items():
            state[f"{region}.{torch.device(device).type}"] = generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Takes the seeds and generator states of ``state_dict()``: generators it holds continue
        from there (those already made are set in place), the others start from the seeds."""
        seeds = [int(v) for v in state["seeds"].tolist()]
        self.replicated_seed, self.split_seed = seeds
        self._loaded = {key: value.clone() for key, value in state.items() if key != "seeds"}
        for (region, device), generator in self._generators.items():
            self._start(generator, region, torch.device(device))

    def _generator(self, region: str, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        key = (region, str(device))
        if key not in self._generators:
            self._generators[key] = self._start(torch.Generator(device=device), region, device)
        return self._generators[key]

    def _start(self, generator: torch.Generator, region: str, device: torch.device) -> torch.Generator:
        loaded = self._loaded.get(f"{region}.{device.type}")
        if loaded is not None:
            return generator.set_state(loaded)
        return generator.manual_seed(self.replicated_seed if region == "replicated" else self.split_seed)


class ReplicatedDropout(nn.Dropout):
    """``nn.Dropout`` whose mask comes from ``rng.replicated_generator``: the same on every rank
    of the tensor group. Stands in for each ``nn.Dropout`` of a tensor-parallel model; ``name``:
    its name in the model, for its errors. A recomputation that draws another mask is a
    ConfigError in backward (see [Note: dropout under the user's activation checkpointing])."""

    def __init__(self, p: float, rng: TensorParallelRNG, inplace: bool = False,
                 name: str | None = None) -> None:
        super().__init__(p, inplace)
        self.rng, self.name = rng, name

    @classmethod
    def from_dense(cls, dense: nn.Dropout, rng: TensorParallelRNG,
                   name: str | None = None) -> ReplicatedDropout:
        replaced = cls(dense.p, rng, dense.inplace, name)
        replaced.train(dense.training)
        return replaced

    def dropout_generator(self, device: torch.device) -> torch.Generator:
        """Where its masks come from (as DilatedAttention names its own; activation
        checkpointing restores it for a recomputation: attention/recompute.py)."""
        return self.rng.replicated_generator(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        generator = self.dropout_generator(x.device)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return generator_dropout(x, self.p, generator, inplace=self.inplace)
        drawn_from = generator.get_state()  # a CPU tensor (5 KB on the CPU, 16 bytes on CUDA)
        dropped = generator_dropout(x, self.p, generator, inplace=self.inplace)
        return _SameMaskWhenRecomputed.apply(dropped, drawn_from, self.name)


class _SameMaskWhenRecomputed(torch.autograd.Function):
    """Identity; backward raises ConfigError if the generator state the mask was drawn from
    differs from the forward's (see the note below).

    [Note: dropout under the user's activation checkpointing]
    ``torch.utils.checkpoint`` (non-reentrant) drops the tensors a block saved for backward and
    recomputes them by running the block again, restoring torch's global generators first, not
    the tensor group's (``TensorParallelRNG``): a ReplicatedDropout recomputed that way draws
    another mask, and the gradients belong to another network, silently. The recomputation cannot
    be told from a forward while it runs, but its saved tensors can: the generator state the mask
    was drawn from is kept twice, as a saved tensor (which checkpoint replaces by the
    recomputation's) and on the autograd node (which it keeps), and backward compares the two. A
    checkpoint given ``context_fn`` = ``attention.recompute.same_dropout_masks`` restores the
    generators, so the states agree and training is exact. Every tensor rank draws from the same
    state, so all raise alike, before any of the block's backward. Reentrant checkpointing
    (``use_reentrant=True``) runs the forward without autograd and is not caught; it has no
    ``context_fn``."""

    @staticmethod
    def forward(ctx, dropped: torch.Tensor, drawn_from: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.drawn_from, ctx.name = drawn_from, name
        ctx.save_for_backward(drawn_from)
        return dropped.view_as(dropped)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (recomputed,) = ctx.saved_tensors
        if not torch.equal(recomputed, ctx.drawn_from):
            name = "a ReplicatedDropout" if ctx.name is None else repr(ctx.name)
            raise ConfigError(
                f"{name} was recomputed by torch.utils.checkpoint with another dropout mask than its "
                "forward drew: under tensor parallelism nn.Dropout draws from the tensor group's "
                "generator (distframe.models.tensor_parallel_rng), which checkpoint does not restore, "
                "so the gradients would be wrong. Pass context_fn=lambda: same_dropout_masks(block, "
                "device) (from attention.recompute) to torch.utils.checkpoint(block, ..., "
                "use_reentrant=False)")
        return grad, None, None


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropouts(model: nn.Module, rng: TensorParallelRNG,
                     include: Callable[[nn.Module], bool] | None = None) -> int:
    """Replaces, in place, every ``nn.Dropout`` of ``model`` (that ``include`` accepts) by a
    ReplicatedDropout; returns how many. Any other dropout module with ``p > 0`` anywhere in
    ``model`` (so every rank raises alike) is a ConfigError: channel or alpha dropout, or a
    subclass of nn.Dropout with its own forward, draws from torch's global generator, a
    different mask on each tensor rank (see [Note: dropout and the tensor group])."""
    for name, module in model.named_modules():
        drawn_alike = type(module) in (nn.Dropout, ReplicatedDropout)
        if isinstance(module, _DROPOUTS) and not drawn_alike and module.p > 0:
            raise ConfigError(f"{name!r} is a {type(module).__name__}(p={module.p}): under tensor "
                              "parallelism only nn.Dropout draws the same mask on every rank of the tensor "
                              "group (this one would let the ranks' replicated parameters drift apart); "
                              "use nn.Dropout or p=0")
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and (include is None or include(child)):
                full_name = f"{parent_name}.{name}" if parent_name else name
                refuse_hooked(child, full_name, "the shared dropout RNG")  # [Note: hooks on replaced modules]
                setattr(parent, name, ReplicatedDropout.from_dense(child, rng, full_name))
                replaced += 1
    return replaced
