"""UnitLifecycle: the hooks that gather, free and reduce ShardedUnits around forward and backward.

Per unit (FSDP2's vocabulary):
  pre_forward    module forward pre-hook: unshard (all_gather), prefetch the next unit in the
                 previous step's forward order (asynchronous all_gather)
  post_forward   module forward hook: register pre_backward on the outputs' gradients; reshard
                 when ``reshard_after_forward``
  end_forward    after the whole model's forward: free units prefetched but not run
  pre_backward   first gradient of an output: unshard again, prefetch the unit that runs next
                 in backward (the previous one in forward order)
  post_backward  the backward reached the unit's inputs (see [Note: where a unit's backward
                 ends]) for the last of its forwards (see [Note: several forwards before one
                 backward]): start the reduce_scatter of the gradients (unless inside no_sync),
                 reshard
``finish()`` starts the reductions of units whose post_backward did not run (the first unit,
parameters without gradients: reduced as zeros, in unit order) and waits for all of them, accumulating each
rank's averaged chunk into its master's ``.grad``. A synchronising backward runs it as its last
act (autograd's queued callback, as DDP's buckets do), so every master holds its gradient when
``backward()`` returns; the model's synchronize_gradients runs it too, and there, after backward
passes that all ran under no_sync, it reduces every unit's accumulated gradients ([Note: a step
after no_sync alone] in left_local_gradients.py).

[Note: ordering] Forward gathers and prefetch follow the order modules actually run, which must
be the same on every rank (as for any FSDP); in backward, gathers and reductions follow that
forward order whatever tensors the units return ([Note: one backward order on every rank] in
unit_order.py); reductions left to ``finish`` are issued last, in unit order.

[Note: a unit whose forward does not run] Only the unit's module's forward hooks gather it. A
module whose forward never runs (an nn.Sequential whose children the parent calls one by one) or
whose parameters are used outside it would run on freed storage (a crash in torch's words) or,
kept gathered (``persistent``, ``reshard_after_forward=False``), on the values of an earlier gather,
stale after each optimizer step, while its gradients still reach the optimizer. So each unit
records whether its forward ran since its masters last changed (``forward_ran``, cleared by
``mark_stale``), and a gradient reaching a unit that has not is ``misuse_error``, at the first
step; the model turns the crash in forward into the same error (``UnitShardedModelBase.forward``).
Hooking every submodule instead would cost a hook call per submodule call on every step.

[Note: where a unit's backward ends] It must end at the same point on every rank, among the
other units' gathers and reductions, or the ranks' collectives no longer pair up. The moment its
last parameter gets its gradient is not such a point: a parameter that gets none on some ranks
only (a gate closed for their rows) leaves them to reduce the unit in ``finish``. So a unit's
backward ends where the backward reaches the inputs of its first call in a forward (as FSDP2's
post_backward), or a tensor made before that call, in the order of [Note: one backward order on
every rank] (unit_order.py); a unit whose inputs need no gradient (the first one), or are leaves,
ends there through an earlier unit's hooks, or in ``finish``. A forward run inside the backward is
a recomputation (activation checkpointing) and records nothing: its units end where the
original forward's hooks (or, for a reentrant checkpoint, whose forward ran without grad, an
earlier unit's hooks) say.

[Note: several forwards before one backward] A step may call the model twice before one
backward (``model(a).sum() + model(b).sum()``, a siamese pair): each forward is a ForwardRecord
whose hooks end the unit in that backward, and autograd sums both calls' gradients into the
parameters' one ``.grad``. Reducing at each end would move the unit's gradients once per forward;
so the step's records (the forwards with grad since the first one after the last ``finish``)
are kept, and an end reduces the unit only when no record of the step still awaits the unit's
end in this backward (``ForwardRecord.awaits``). Each end is at a point of the forward that is
the same on every rank, so the last one is too. An earlier end only puts the unit back as after
its forward (IDLE, resharded when ``reshard_after_forward``) for its next backward run. A
forward whose graph no backward reaches (its output discarded, or left for a later backward)
keeps its units awaited: ``finish`` reduces them, once, in unit order, at the end of the pass.
So does the next backward over it (``l1.backward(); l2.backward()``: the first has ended nothing
of the second's forward). A forward without grad makes no record; a no_sync backward ends its
units with the same backward number as the synchronising one (``finish`` did not run between),
so its records await nothing that backward reached. The cost of a stale record (a forward with
grad that never got a backward, such as an evaluation without ``torch.no_grad``) is overlap:
the units it ran are reduced by ``finish`` in that step, not during the backward.

[Note: an output the hooks cannot see] A unit's output is hooked to gather it again for its
backward; the tensors are found in torch's pytree containers and in dataclasses (``tensors_in``
in backward_end.py). An output holding its tensors where neither looks (an object of another
class) leaves nothing to hook, and a unit freed after such a forward would run its backward on
freed storage; so it stays gathered until its backward ends (its inputs' hook, or ``finish``),
as with ``reshard_after_forward=False``.

[Note: hooks added later] A unit's post-forward hook reshards it, so it must run after every
other forward hook of its module: torch runs them in the order they were registered, and a
user's hook registered after wrapping (reading ``module.weight``) read the NaN stand-in. Each
forward moves the unit's hook to the end of its module's hooks where another came after it (an
ordered dict: one comparison per unit call when none did).

[Note: double backward] A backward with ``create_graph=True`` (a gradient penalty) builds a graph
over the unit's gathered parameters, which the unit frees when its backward ends, so a second
backward through it read freed storage (torch's "setStorage ... out of bounds for storage of size
0"). Such a backward runs with grad mode on, and the hook on a unit's output refuses it with a
ConfigError on every rank alike (every rank runs the same backward), before anything is gathered
(torch's FSDP1 documents double backward as unsupported too). A recomputation in backward
(activation checkpointing) also runs with grad on, but in forward hooks, which do not check.

[Note: parameters without a gradient] A unit reduces its flat gradient whole, so a parameter
that got no gradient is averaged as zeros and the optimizer, stepping the unit's master chunk,
moves it (weight decay, momentum) where one process would leave it alone. Each parameter's
gradient hook marks it in ``usage`` (a list write, no communication); a synchronising ``finish``
has ``usage`` warn once per rank, naming those without one; ``begin_forward`` forgets the marks
of gradients that were cleared since (ParameterUsage, as DDP and ZeRO-1/2 have it).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.types import Work
from distframe.errors import ConfigError
from distframe.models.backward_end import BackwardEnd, PassAccumulation
from distframe.models.config import TrainingState
from distframe.models.left_local_gradients import holds_local_gradients
from distframe.models.parameter_usage import ParameterUsage
from distframe.models.sharded_unit import ShardedUnit
from distframe.models.unit_order import ForwardRecord, hook_inputs, in_backward, unit_ancestors
from distframe.models.weak_hooks import weak_hook


class UnitLifecycle:
    def __init__(self, units: list[ShardedUnit], root: torch.nn.Module, *, reshard_after_forward: bool,
                 prefetch: bool,
                 misuse_error: Callable[[ShardedUnit, str], Exception],
                 usage: Callable[[list[str], list[torch.nn.Parameter]], ParameterUsage]) -> None:
        self.units = units
        # Which parameters hold a gradient (units' parameters in unit order), so a synchronisation
        # that averages some as zeros says so: see [Note: parameters without a gradient].
        entries = [e for unit in units for e in unit.space.entries]
        self.usage = usage([e.name for e in entries], [e.param for e in entries])
        self.misuse_error = misuse_error  # (unit, what went wrong) -> the error to raise
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.synchronize = False  # set by each forward that may be followed by backward
        self._armed = False
        self._left_local = False  # a no_sync backward left gradients: [Note: a step after no_sync alone]
        self._backward_end = BackwardEnd(self.finish)
        # See [Note: a pass that only reads gradients] in backward_end.py.
        self._accumulation = PassAccumulation([p for unit in units for p in unit.params])
        self._record = ForwardRecord()       # units of this step's forward, in order
        # This step's forwards with grad: see [Note: several forwards before one backward].
        self._step_records: list[ForwardRecord] = []
        self._step_done = False              # a finish ran: the next forward starts a step
        self._recording = False              # whether the model's forward runs with grad
        self._last_order: list[int] = []     # forward order of the previous step (for prefetch)
        self._backward_number = 0            # told apart so a second backward ends units again
        self._ancestors = unit_ancestors(root, [u.module for u in units])
        self._pending: list[tuple[ShardedUnit, Work]] = []
        self._handles = []
        self._post_hook_ids: list[int] = []  # each unit's post-forward hook: [Note: hooks added later]
        index = 0
        for unit in units:
            # First of the unit's pre-hooks, as FSDP2's: one registered before wrapping (the
            # hook-based weight_norm and spectral_norm) reads the unit's gathered parameters.
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda module, args, kwargs, unit=unit: self.pre_forward(unit, args, kwargs),
                with_kwargs=True, prepend=True))
            self._handles.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self.post_forward(unit, output)))
            self._post_hook_ids.append(self._handles[-1].id)
            for param in unit.params:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(  # weak_hooks.py
                        weak_hook(self._on_gradient_accumulated, unit.index, index)))
                index += 1

    def begin_forward(self, synchronize: bool) -> None:
        """Called by the model before the wrapped forward."""
        if self._armed and any(u.reduce_launched for u in self.units):
            self.finish()  # a backward ran without a step; keep the ranks' collectives aligned
        for unit in self.units:
            if unit.state is TrainingState.PRE_BACKWARD:
                # Left by a backward that never completed the unit's gradients (no_sync, unused
                # parameters, autograd.grad): a new forward is not a recomputation inside it.
                unit.state = TrainingState.IDLE
                unit.reshard()
        self._recording = torch.is_grad_enabled()
        if not self._recording:
            # No backward follows this forward (an evaluation, perhaps between a training
            # forward and its backward): that backward must still find its own settings.
            return
        self._forget_cleared_gradients()
        if self._record.order:
            self._last_order = self._record.order
        self._record = ForwardRecord()
        if self._step_done:
            self._step_records, self._step_done = [], False
        self._step_records.append(self._record)
        self.synchronize = synchronize
        self._armed = synchronize
        self._backward_end.reset()  # a backward that raised never ran its callback

    def end_forward(self, output: Any) -> None:
        """Called by the model after the wrapped forward. Frees a unit whose prefetch is still in
        flight: the prefetch followed the previous forward's order and this forward did not run
        the unit (its own pre_forward would have waited for it), so nothing needs it before its
        next gather. Hooks the model's ``output`` so that the backward starting from it queues
        ``finish``; its first gradient is the output's, so the finish lands on the user's
        backward, not on one nested inside it (reentrant activation checkpointing)."""
        for unit in self.units:
            if unit.prefetch_in_flight:
                unit.reshard()
        if self._armed and torch.is_grad_enabled():
            self._backward_end.watch(output, self._backward_running)

    @property
    def forward_order(self) -> list[int]:
        """The units the latest forward with grad ran, by index, in the order of their first call."""
        return self._record.order

    def forward_raised(self) -> None:
        """The model's forward raised (a bad batch the user skips): the units it left in their
        forward, gathered, go back to rest, freed, as their post-forward hooks would have left
        them; otherwise summon_full_parameters() took them for running and their copies stayed."""
        for unit in self.units:
            if unit.state is TrainingState.FORWARD:
                unit.state = TrainingState.IDLE
                unit.reshard()

    # ---- forward -----------------------------------------------------------------------------
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> None:
        unit.forward_ran = True
        if unit.state is TrainingState.PRE_BACKWARD:
            # Activation checkpointing recomputes the forward inside the unit's backward: its
            # pre_backward gathered it, and its backward still needs it (as FSDP2 does).
            unit.unshard()
            return
        if in_backward():
            # A recomputation (activation checkpointing) that a node of the unit's own backward
            # asked for: that backward has begun, on every rank, whether or not the hook on
            # the unit's output ran yet (see [Note: where a unit's backward ends]).
            self._output_reached(unit, self._record, None)
            return
        unit.state = TrainingState.FORWARD
        hooks, own = unit.module._forward_hooks, self._post_hook_ids[unit.index]
        if next(reversed(hooks)) != own:  # see [Note: hooks added later]
            hooks.move_to_end(own)
        record = self._record
        position = record.add(unit.index) if self._recording else None
        unit.unshard()
        if self.prefetch:
            self._prefetch_after(unit.index, self._last_order)
        # Only a unit's first call in a forward: the backward reaches its inputs last.
        if position is not None and torch.is_grad_enabled():
            hook_inputs(args, kwargs, lambda: self._end_backwards(record, position))

    def post_forward(self, unit: ShardedUnit, output: Any) -> None:
        if unit.state is TrainingState.PRE_BACKWARD:
            return  # a recomputation in backward (see pre_forward): keep the unit gathered
        seen = True
        if torch.is_grad_enabled():
            record, boundary = self._record, len(self._record.order)
            seen = self._backward_end.watch(
                output, lambda grad: self._gradient_reached(unit, record, boundary)) > 0
        # An output with no tensor to hook: see [Note: an output the hooks cannot see].
        if (self.reshard_after_forward and seen) or not torch.is_grad_enabled():
            unit.reshard()
        unit.state = TrainingState.IDLE

    # ---- backward ----------------------------------------------------------------------------
    def _gradient_reached(self, unit: ShardedUnit, record: ForwardRecord, boundary: int) -> None:
        """The hook on a unit's output: its backward begins."""
        if torch.is_grad_enabled():  # a backward with create_graph=True: see [Note: double backward]
            raise ConfigError(
                "ZeRO-3/FSDP cannot differentiate through a backward (create_graph=True, e.g. a "
                "gradient penalty or higher-order gradients): a unit's gathered parameters are freed "
                "after its backward, and the graph that backward builds would read them. DDPModel "
                "and ZeRO1Model/ZeRO2Model, which keep whole parameters, support such a loss")
        self._output_reached(unit, record, boundary)

    def _output_reached(self, unit: ShardedUnit, record: ForwardRecord, boundary: int | None) -> None:
        """See [Note: one backward order on every rank] in unit_order.py."""
        if boundary is not None:
            self._end_backwards(record, boundary)
        for index in self._ancestors[unit.index]:
            ancestor = self.units[index]
            if ancestor.state is TrainingState.IDLE and index in record.position:
                self.pre_backward(ancestor)
        self.pre_backward(unit)

    def _end_backwards(self, record: ForwardRecord, boundary: int) -> None:
        backward = self._backward_number
        for index in record.to_end(boundary, backward):
            unit = self.units[index]
            if any(step_record.awaits(index, backward) for step_record in self._step_records):
                self._between_backward_runs(unit)
            else:
                self.post_backward(unit)

    def _between_backward_runs(self, unit: ShardedUnit) -> None:
        """One of the unit's backward runs ended, another forward's is still awaited: no reduction
        yet (see [Note: several forwards before one backward]); back to as after forward."""
        unit.state = TrainingState.IDLE
        if self.reshard_after_forward:
            unit.reshard()

    def pre_backward(self, unit: ShardedUnit) -> None:
        if unit.state is TrainingState.PRE_BACKWARD:
            return
        unit.state = TrainingState.PRE_BACKWARD
        unit.unshard()
        if self.prefetch:
            self._prefetch_after(unit.index, self._record.order[::-1])

    def _on_gradient_accumulated(self, unit_index: int, index: int, param: torch.nn.Parameter) -> None:
        unit = self.units[unit_index]
        if not unit.forward_ran:  # see [Note: a unit whose forward does not run]
            raise self.misuse_error(unit, "its parameters got gradients in a step in which its forward "
                                          "did not run (or ran before the last optimizer step, which "
                                          "changed the weights that forward used; torch refuses that too)")
        self.usage.has_gradient[index] = True
        if not self.synchronize:
            self._left_local = True  # [Note: a step after no_sync alone]
            if unit.accumulates:
                unit.keep_accumulated(param)
        self._backward_running()  # in case no output was watched (a loss that bypasses it)
        unit.ready.add(id(param))

    def post_backward(self, unit: ShardedUnit) -> None:
        unit.ready.clear()
        unit.state = TrainingState.POST_BACKWARD
        # Every time: a unit whose gradients complete again in the same step (a second backward
        # over one forward, or a shared unit under reentrant checkpointing, whose nested
        # backwards each accumulate its parameters) has new gradients to reduce.
        if self.synchronize and self._armed and self._accumulation.accumulates():
            self._complete_finished()
            self._pending.append((unit, unit.reduce_gradients()))
        unit.reshard()

    def finish(self) -> None:
        """Completes this step's gradient reductions (see the module docstring); collective."""
        synchronising = self._armed and self._accumulation.accumulates()
        if not self._armed and self._left_local:  # outside a backward: the step's
            synchronising = self._left_local = holds_local_gradients(self.units)
        if synchronising:
            for unit in self.units:
                if not unit.reduce_launched or unit.ready:  # none reduced yet, or some since
                    self._pending.append((unit, unit.reduce_gradients()))
        while self._pending:
            unit, work = self._pending.pop(0)
            unit.accumulate(work.wait())
        for unit in self.units:
            unit.reduce_launched = False
            unit.ready.clear()
            unit.state = TrainingState.IDLE
            unit.reshard()
        self._armed = False
        self._backward_number += 1
        self._step_done = True
        if synchronising:
            self._left_local = False
            self.usage.finish(None)  # warns once if a parameter was averaged as zeros

    def _forget_cleared_gradients(self) -> None:
        """A parameter holds a gradient from its first gradient hook until it is cleared: its own
        ``.grad`` (local, under no_sync), its unit's ``accumulated`` (no_sync under mixed
        precision) and its master ``.grad`` (zero_grad) all None."""
        has_gradient, index = self.usage.has_gradient, 0
        for unit in self.units:
            if unit.master.grad is None and unit.accumulated is None:
                for i, param in enumerate(unit.params, index):
                    if param.grad is None:
                        has_gradient[i] = False
            index += len(unit.params)

    def _backward_running(self, *_: Any) -> None:
        """A backward over a synchronising forward is running (again, after a retain_graph
        one): it owes its reductions and finishes them as its last act."""
        if not self.synchronize:
            return
        self._armed = True
        self._backward_end.queue()

    def awaiting_backward(self) -> bool:
        """Whether a forward with grad of this step ran units whose backward has not ended."""
        return not self._step_done and any(record.awaits(index, self._backward_number)
                                           for record in self._step_records for index in record.order)

    def mark_stale(self) -> None:
        """Masters changed (optimizer step, load): gathered copies must be refreshed."""
        for unit in self.units:
            unit.drop_prefetch()
            unit.stale = True
            unit.forward_ran = False

    def _complete_finished(self) -> None:
        while self._pending and self._pending[0][1].is_completed():
            unit, work = self._pending.pop(0)
            unit.accumulate(work.wait())

    def _prefetch_after(self, index: int, order: list[int]) -> None:
        if index in order:
            position = order.index(index)
            if position + 1 < len(order):
                upcoming = self.units[order[position + 1]]
                if upcoming.state is not TrainingState.POST_BACKWARD:
                    upcoming.unshard(async_op=True)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
