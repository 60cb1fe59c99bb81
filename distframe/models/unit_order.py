"""The order in which a sharded unit's backward begins and ends, the same on every rank whatever
tensors the units return (see [Note: one backward order on every rank]).

[Note: one backward order on every rank] A unit's pre_backward (gather) is a hook on its outputs
and its post_backward (reduce_scatter) ends at its inputs. Hooks on one tensor run in the order
they were registered, hooks on two tensors in the order autograd reaches them; so a unit that
returns its child unit's output itself on some ranks and a new tensor on others, or a parent that
hands one unit's output to the next as it is on some ranks only, ran the same hooks in another
order there, and the collectives paired up wrong. Two facts give one order instead. (1) The
engine runs a device's nodes latest-created first, so when the backward reaches a tensor created
at some point of the forward, every node created after that point has run: every unit whose
first call in that forward started later has finished its backward. (2) A unit's backward begins
inside its ancestors' (the units whose modules contain its module), which need their parameters
for everything created before it. So each hook carries the point of the forward where its tensor
was made (``boundary``: how many units had started then), and a hook first ends, latest-started
first, every unit of that forward that started at or after its boundary and has not ended in this
backward, then (an output hook) begins its unit's ancestors, outermost first, then its unit.
Whichever tensor a hook sits on and whichever of several hooks on one tensor runs first, the
collectives come in that order. A unit whose output the loss does not reach on some ranks ends
there at the same point as elsewhere, with zeros for its gradients.

[Note: one forward order on every rank] Forward gathers follow the order modules run, so that
order must be the same on every rank. Where it is not, each all_gather pairs one unit's chunk on
one rank with another unit's on another: units of different sizes make the engines' signature
check fail (CollectiveMismatchError; always in memory, with ``debug=True`` elsewhere), units of one
size gather parameters mixed across ranks without an error. The collectives do not carry which
unit they are for, so ``forward_orders`` compares the orders themselves (one small all_gather);
the model calls it after the first forward with grad (``ShardingConfig.check_structure``) and
after every one on a backend in ``debug`` mode.

Leaf tensors are not hooked as inputs: autograd accumulates a leaf's gradient as soon as its last
user has run, possibly before other nodes of the unit, which would end the unit too early (and
reduce it again at the end). Such a unit, and one whose inputs need no gradient, ends with an
earlier-started unit's hook or in ``finish``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distframe.backends.protocol import ICommunicationBackend
from distframe.models.backward_end import tensors_in


class ForwardRecord:
    """The units one forward (with grad) called, in the order of their first call, and the
    backward (by number) in which each one's backward last ended."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.ended: dict[int, int] = {}

    def add(self, index: int) -> int | None:
        """The unit's position if this is its first call in this forward, else None."""
        if index in self.position:
            return None
        self.position[index] = len(self.order)
        self.order.append(index)
        return self.position[index]

    def awaits(self, index: int, backward: int) -> bool:
        """Whether the unit ran in this forward and its backward has not ended in backward
        number ``backward`` (not yet, or never: an output no backward reaches)."""
        return index in self.position and self.ended.get(index) != backward

    def to_end(self, boundary: int, backward: int) -> list[int]:
        """Units started at or after ``boundary`` not yet ended in backward number ``backward``,
        latest-started first; marks them ended."""
        out = []
        for index in reversed(self.order[boundary:]):
            if self.ended.get(index) != backward:
                self.ended[index] = backward
                out.append(index)
        return out


def forward_orders(order: list[int], unit_count: int, backend: ICommunicationBackend,
                   device: torch.device) -> list[list[int]]:
    """Every rank's ``order`` (unit indices, at most ``unit_count`` of them), in rank order: one
    all_gather of ``unit_count + 1`` integers on ``device`` (the units', for NCCL; collective)."""
    codes = torch.full((unit_count + 1,), -1, dtype=torch.int64, device=device)
    codes[0] = len(order)
    codes[1:1 + len(order)] = torch.tensor(order, dtype=torch.int64)
    rows = backend.all_gather(codes).view(backend.world_size, unit_count + 1).tolist()
    return [row[1:1 + row[0]] for row in rows]


def unit_ancestors(root: nn.Module, unit_modules: list[nn.Module]) -> list[list[int]]:
    """For each unit (by its module), the indices of the units whose modules contain it,
    outermost first, by the module tree under ``root`` (the same on every rank)."""
    index_of = {id(m): i for i, m in enumerate(unit_modules)}
    ancestors: list[list[int] | None] = [None] * len(unit_modules)
    stack: list[tuple[nn.Module, list[int]]] = [(root, [])]
    seen: set[int] = set()
    while stack:
        module, above = stack.pop()
        if id(module) in seen:  # a module reachable under two names: its first place
            continue
        seen.add(id(module))
        here = index_of.get(id(module))
        if here is not None and ancestors[here] is None:
            ancestors[here] = above
            above = above + [here]
        stack.extend((child, above) for child in reversed(list(module.children())))
    return [a or [] for a in ancestors]


def hook_inputs(args: tuple, kwargs: dict, callback: Callable[[], None]) -> None:
    """Calls ``callback`` when the backward reaches any non-leaf tensor among the inputs that
    requires grad (see the Note on leaves above)."""
    for tensor in tensors_in((args, kwargs)):
        if tensor.requires_grad and tensor.grad_fn is not None:
            tensor.register_hook(lambda grad: callback())


def in_backward() -> bool:
    """Whether autograd is running a node on this thread: a forward then is a recomputation
    (activation checkpointing), not a new forward of the model."""
    return torch._C._current_autograd_node() is not None
