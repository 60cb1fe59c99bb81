"""What a data-parallel wrapper checks and adapts in the user's modules when it wraps them:
``prepare_replicated_modules`` (no communication).

[Note: embeddings that renormalise in forward] nn.Embedding(max_norm=...) and
nn.EmbeddingBag(max_norm=...) rescale, in place during forward, the rows of their weight that this
forward looks up. Each data-parallel rank looks up its own slice's rows, so each rank's replica is
edited differently: under DDP the replicas drifted apart (1.58 after one SGD step), under ZeRO-1/2
each rank's edit reached only its own chunk of the masters (0.34 off one process). No merge of such
edits is exact in general (a row two ranks renormalised from different weights), so wrapping one
over more than one data-parallel rank is a ConfigError naming the module and what to change.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.models.sync_batchnorm import check_sync_batch_norms, synchronise_batch_norms


def prepare_replicated_modules(owner: Any, module: nn.Module, group: ICommunicationBackend) -> None:
    """Called by a wrapper (``owner``) whose data-parallel ``group`` trains replicas of ``module``,
    before it changes ``module``: with more than one rank, the checks ([Note: embeddings that
    renormalise in forward], check_sync_batch_norms), then every nn.SyncBatchNorm synchronises over
    ``group`` ([Note: SyncBatchNorm under distframe] in sync_batchnorm.py)."""
    if group.world_size == 1:
        return
    strategy = type(owner).__name__
    refuse_renormalising_embeddings(module, strategy)
    check_sync_batch_norms(module, strategy)
    synchronise_batch_norms(module, owner, group)


def refuse_renormalising_embeddings(module: nn.Module, strategy: str) -> None:
    """ConfigError for an embedding of ``module`` with ``max_norm`` (see the note)."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None:
            shown = f"'{name}'" if name else "the model"
            raise ConfigError(
                f"{strategy}: {shown} ({type(sub).__name__}) has max_norm={sub.max_norm}, which rescales "
                "in place, during forward, only the rows this rank looks up, so the data-parallel "
                "replicas would drift apart (and from one process's training); drop max_norm, or "
                "renormalise outside forward, after each optimizer step, the same way on every rank "
                "(under torch.no_grad(): weight.copy_(torch.renorm(weight, 2, 0, max_norm)); under "
                "ZeRO-3/FSDP inside model.summon_full_parameters())")
