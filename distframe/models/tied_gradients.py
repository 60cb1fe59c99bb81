"""Gradients of weights tied across pipeline stages (the LM's embedding and head).

Each stage holding a tied weight computes its own part of the gradient; one all_reduce(SUM) per
group of stages (and dtype) gives every copy the whole gradient, so the copies stay equal after
the optimizer step. A backward that follows such a sum without zero_grad adds its gradient to
the sum (accumulation, as with torch DDP): summed again, the earlier sum would count once per
stage. ``set_aside`` (before that backward) keeps a copy of the summed gradients, and the next
``all_reduce`` sums only what the backwards since added. A gradient cleared in between (set to
None, as torch's ``zero_grad`` does by default, or ``forget``) is summed whole; so is one zeroed
in place (``zero_grad(set_to_none=False)`` of a plain optimizer, which the model never sees): its
version counter moved by more than the backwards since accumulated into it (each adds in place,
once, counted by a post-accumulate-grad hook), where subtracting the kept sum gave every stage's
copy the new gradients less the old sum.
"""
from __future__ import annotations

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.types import ReduceOp
from distframe.models.hybrid_state import LocalParameter, all_reduce_grads
from distframe.models.weak_hooks import weak_hook


class TiedGradients:
    """``groups``: ``[(group of the stages holding the weights, this rank's copies)]``."""

    def __init__(self, groups: list[tuple[ICommunicationBackend, list[torch.Tensor]]]) -> None:
        self.groups = groups
        # id: (.grad, its sum, its version, accumulations) when set aside
        self._summed: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._accumulated: dict[int, int] = {}  # id: backwards that accumulated into .grad
        for _, params in groups:
            for p in params:
                self._accumulated[id(p)] = 0
                if p.requires_grad:  # frozen ones never get a gradient (and take no hook)
                    p.register_post_accumulate_grad_hook(weak_hook(self._count))

    def _count(self, param: torch.Tensor) -> None:
        self._accumulated[id(param)] += 1

    @classmethod
    def for_stages(cls, shared: dict[tuple[int, ...], list[str]], local: list[LocalParameter],
                   pp_group: ICommunicationBackend) -> TiedGradients:
        """``shared``: names of the weights each tuple of stages holds (``ParameterCatalog.
        shared_across_stages``); one subgroup of ``pp_group`` per tuple (collective on it)."""
        by_name = {lp.name: lp.param for lp in local}
        groups = []
        for stages, names in sorted(shared.items()):
            group = pp_group.new_group(list(stages))
            if group is not None:
                groups.append((group, [by_name[n] for n in names]))
        return cls(groups)

    def set_aside(self) -> None:
        """Before a backward that follows ``all_reduce`` (no zero_grad between)."""
        self._summed = {id(p): (p.grad, p.grad.detach().clone(), p.grad._version, self._accumulated[id(p)])
                        for _, params in self.groups for p in params
                        if p.requires_grad and p.grad is not None}

    def forget(self) -> None:
        """The gradients were cleared: the next ``all_reduce`` sums them whole."""
        self._summed = {}

    def all_reduce(self, keep_unused: bool = False) -> None:
        """Every copy's gradient becomes the sum over the stages (collective on each group);
        ``keep_unused``: a weight no stage gave a gradient keeps ``.grad = None``."""
        for group, params in self.groups:
            trainable = [p for p in params if p.requires_grad]
            summed = [(p, self._summed[id(p)][1]) for p in trainable if self._still_summed(p)]
            for p, before in summed:
                p.grad.sub_(before)
            all_reduce_grads(trainable, group, ReduceOp.SUM, keep_unused)
            for p, before in summed:
                p.grad.add_(before)
        self._summed = {}

    def _still_summed(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is the set-aside sum plus what backwards accumulated since, and
        nothing else changed it in place."""
        if id(p) not in self._summed:
            return False
        grad, _, version, accumulated = self._summed[id(p)]
        return p.grad is grad and grad._version - version == self._accumulated[id(p)] - accumulated
