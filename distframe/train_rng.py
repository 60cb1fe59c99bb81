"""Each rank's random streams in ``distframe train``: where its dropout masks come from, and the
generator states every checkpoint keeps so that ``--resume`` continues them.

[Note: dropout in the main job]
In-memory ranks are threads of one process, and torch's global generator is shared by them: masks
drawn from it interleave between ranks in whatever order the threads run, so two runs with one
seed differ. So with ``--dropout P > 0`` every dropout draws from generators of its own rank:

* tensor-parallel models (``--tp`` above 1) bring theirs: HybridShardedModel's TensorParallelRNG
  (``distframe.models.tensor_parallel_rng``), seeded with ``dropout_seed(--seed)``;
* otherwise ``use_rank_generators`` replaces, before the strategy wraps the model, each
  ``nn.Dropout`` by a ReplicatedDropout and each ``DilatedAttention`` by a RankDilatedAttention,
  both drawing from one TensorParallelRNG of this rank alone, seeded from ``--seed`` and the rank.

With ``--dropout 0`` nothing draws and the model stays as built.

[Note: generator states in checkpoints]
``RankRandomState.state()`` is what each rank saves with a checkpoint (``rank_state`` of
``distframe.checkpoint.save``): torch's CPU generator state, the CUDA one of its device when it
trains on a GPU, and its dropout generators' ``state_dict()``, keyed
``<layout>/rank<r>/<entry>``; the metadata records the layout (strategy, world size, dp, tp, pp,
cp and, for an interleaved pipeline, the model chunks of a rank: the same generator feeds other
layers in another order when the chunking changes). A resume with the same layout gives every rank
its states back, so the resumed run draws the masks the uninterrupted run drew. Under another
layout the saved streams have no counterpart (which rank's stream would a new rank take?), and a
checkpoint written before distframe kept them has none: the dropout generators then start new
streams seeded from their seeds (a function of ``--seed`` and the rank's coordinates) and the
step, and the run says so in a note.

The elastic run (``train_elastic``) reads a checkpoint's states while its optimizer restores
(``read_saved``, then ``take``). A membership change, or a rollback after a failure, restores a
commit, which holds no generator states: the new group starts new streams seeded from the step of
the commit (``new_streams``), never its ranks' initial streams, whose masks earlier steps used.
A resume at another layout at that step draws the same streams, so it equals the elastic run.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from distframe.models.rank_dropout import RankDilatedAttention, draw_from
from distframe.models.tensor_parallel_rng import (ReplicatedDropout, TensorParallelRNG, derive_seed,
                                                  replace_dropouts)
from distframe.train_strategies import STRATEGIES

_DROPOUT = "dropout."


def dropout_seed(seed: int) -> int:
    """The base seed of a tensor-parallel model's dropout generators for ``--seed``."""
    return derive_seed(seed, "dropout")


def layout(config: Any, world_size: int) -> dict[str, Any]:
    """What decides which stream each rank draws: the strategy, the world, its degrees and, for
    an interleaved pipeline, the model chunks each rank holds (its generators feed those)."""
    if not STRATEGIES[config.strategy].model_parallel:
        return {"strategy": config.strategy, "world_size": world_size, "dp": world_size, "tp": 1,
                "pp": 1, "cp": 1}
    dp, tp, pp = config.parallel_degrees(world_size)
    found = {"strategy": config.strategy, "world_size": world_size, "dp": dp, "tp": tp, "pp": pp,
             "cp": config.cp}
    # Only above 1: one chunk per rank is the layout that checkpoints written before chunks
    # counted recorded, and those keep continuing their masks exactly.
    if config.virtual_stages > 1:
        found["virtual_stages"] = config.virtual_stages
    return found


def use_rank_generators(module: nn.Module, config: Any, world_size: int, rank: int) -> None:
    """Points every dropout of ``module`` (the unwrapped LM) at a generator of this rank alone;
    nothing when ``--dropout`` is 0 or the strategy's tensor-parallel model brings its own."""
    if not config.dropout or layout(config, world_size)["tp"] > 1:
        return
    rng = TensorParallelRNG(derive_seed(config.seed, "rank dropout", "replicated", rank),
                            derive_seed(config.seed, "rank dropout", "split", rank))
    replace_dropouts(module, rng)
    draw_from(module, rng, lambda _: True, inactive=True)


def dropout_generators(model: nn.Module) -> TensorParallelRNG | None:
    """The wrapped ``model``'s dropout generators: a tensor-parallel model's, else those
    ``use_rank_generators`` installed, else None."""
    found = getattr(model, "dropout_rng", None)
    if found is not None:
        return found
    return next((m.rng for m in model.modules() if isinstance(m, (ReplicatedDropout, RankDilatedAttention))),
                None)


@dataclasses.dataclass(frozen=True)
class SavedStates:
    """What a checkpoint holds for one rank: the layout its generator states were saved in (None:
    it holds none) and, when that is the layout asked for, this rank's states (else None)."""

    layout: dict[str, Any] | None
    state: dict[str, torch.Tensor] | None


def read_saved(meta: dict[str, Any], reader: Any, where: dict[str, Any], rank: int) -> SavedStates:
    """Rank ``rank``'s states in a checkpoint (``meta``, ``reader`` as checkpoint.load hands
    ``read_rank_state``) when it was saved in layout ``where``. Needs no model: the elastic run
    reads them while its optimizer restores, before the job's RankRandomState exists."""
    saved = meta.get("rank_state")
    saved_layout = saved.get("layout") if isinstance(saved, dict) else None
    if saved_layout != where:
        return SavedStates(saved_layout, None)
    state = {name: value.clone() for name, value in reader.wholes("rank_state", _prefix(where, rank)).items()}
    if "torch.cpu" not in state:
        raise ValueError(f"the checkpoint lists generator states of layout {where} but "
                         f"holds none for rank {rank}: it is incomplete; load an earlier one")
    return SavedStates(saved_layout, state)


def _prefix(where: dict[str, Any], rank: int) -> str:
    """``<strategy>.<degrees>/rank<r>/``: where a rank's states lie in a checkpoint."""
    degrees = ".".join(f"{k}{v}" for k, v in where.items() if k != "strategy")
    return f"{where['strategy']}.{degrees}/rank{rank}/"


class RankRandomState:
    """This rank's generators in the main job (see the module notes): ``state()`` and ``info()``
    for a checkpoint's save, ``read(meta, reader)`` (or ``take`` what ``read_saved`` read) for
    its load, then ``continue_from(step)``; ``new_streams`` where no checkpoint was loaded."""

    def __init__(self, config: Any, backend: Any, model: nn.Module, device: torch.device) -> None:
        self.config, self.rank, self.device = config, backend.rank, device
        self.layout = layout(config, backend.world_size)
        self.dropout = dropout_generators(model)
        self.saved_layout: dict[str, Any] | None = None
        self.restored = False

    def info(self) -> dict[str, Any]:
        return {"layout": self.layout}

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's generator states, keyed by layout and rank."""
        state = {"torch.cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["torch.cuda"] = torch.cuda.get_rng_state(self.device)
        if self.dropout is not None:
            state.update({_DROPOUT + k: v for k, v in self.dropout.state_dict().items()})
        prefix = _prefix(self.layout, self.rank)
        return {prefix + k: v for k, v in state.items()}

    def read(self, meta: dict[str, Any], reader: Any) -> None:
        """Restores the states this rank saved, when the checkpoint was saved in this layout."""
        self.take(read_saved(meta, reader, self.layout, self.rank))

    def take(self, saved: SavedStates) -> None:
        """Restores ``saved`` (``read_saved`` for this layout and rank), where it holds states."""
        self.saved_layout = saved.layout
        self.restored = saved.state is not None
        if saved.state is None:
            return
        state = saved.state
        torch.set_rng_state(state["torch.cpu"])
        if "torch.cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["torch.cuda"], self.device)
        dropout = {k[len(_DROPOUT):]: v for k, v in state.items() if k.startswith(_DROPOUT)}
        if self.dropout is not None and dropout:
            self.dropout.load_state_dict(dropout)

    def continue_from(self, step: int) -> str | None:
        """After a load: where ``read`` restored nothing, ``new_streams(step, why)``; returns
        its note, else None."""
        if self.restored:
            return None
        if self.saved_layout is None:
            why = "the checkpoint holds no generator states (saved before distframe kept them)"
        else:
            why = (f"the checkpoint was saved by {_describe(self.saved_layout)}, not this layout; "
                   "resume with that one to continue its masks exactly")
        return self.new_streams(step, why)

    def new_streams(self, step: int, why: str) -> str | None:
        """New dropout streams seeded from the generators' seeds (``--seed`` and the rank's
        coordinates) and ``step``, for masks from step ``step + 1`` on; returns a note saying so
        and ``why`` when ``--dropout`` is above 0, else None."""
        if self.dropout is None:
            return None
        seeds = [derive_seed(self.dropout.replicated_seed, "resume", step),
                 derive_seed(self.dropout.split_seed, "resume", step)]
        self.dropout.load_state_dict({"seeds": torch.tensor(seeds, dtype=torch.int64)})
        if not self.config.dropout:  # a tensor-parallel model's generators, but nothing draws
            return None
        return (f"distframe train: dropout masks from step {step + 1} on are new, seeded from --seed "
                f"and the step: {why}")


def _describe(layout: dict[str, Any]) -> str:
    chunks = (f" virtual_stages={layout['virtual_stages']}" if "virtual_stages" in layout else "")
    return (f"--strategy {layout.get('strategy')} --world-size {layout.get('world_size')} ("
            + " ".join(f"{k}={layout.get(k)}" for k in ("dp", "tp", "pp", "cp")) + chunks + ")")
