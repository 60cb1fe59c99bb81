"""Membership changes on the in-memory engine: ``ElasticController`` runs workers (threads) in
successive groups, changing who is in the group between steps.

Each group ("generation") is a fresh in-memory group of the current members. A member keeps its
identity and its newest commit (``ElasticMember``) from one generation to the next. A generation
ends in one of two ways:

* cleanly, at a scheduled step (``schedule``: step -> new world size): every member's
  ElasticOptimizer commits at that step; members beyond the new size leave, new members join
  with nothing and receive the commit when the next group's optimizers are built;
* by a failure: a worker raises; the others stop at once (RankFailedError) and the survivors
  roll back to their newest commit in the next generation, one member fewer (where they hold
  the commit of a scheduled step, that step's change is made all the same). A worker that
  stalls is a failure too: its peers' collective times out naming it as missing, and it is
  dropped, not they; a thread that has still not returned ``timeout`` seconds after a peer
  ended is abandoned ([Note: a worker that never returns]).

The controller tells every member the step of the run's newest commit
(``ElasticMember.newest_committed_step``). Where every worker that held it failed (the holders
died before joiners received it), the next group's restore cannot reach it: it restores a
checkpoint of that step, or raises ElasticRollbackError, and the controller ends the run with
that error instead of going on from an older state (workers whose ElasticOptimizer has
``allow_rollback=True`` go on from it with a warning naming the steps lost). A ConfigError raised
by a worker (bad settings, a GradScaler not registered) ends the run the same way.

``worker_fn(backend, member)`` builds the model and an ``ElasticOptimizer(..., member=member)``
and trains until ``optimizer.membership_changes`` or its own end; it is called once per member
per generation. The group's world size changes, the global batch does not
(``ElasticOptimizer.local_slice``).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from distframe.backends.inmemory import InMemoryCommunicationBackend
from distframe.errors import CollectiveTimeoutError, ConfigError, RankFailedError
from distframe.launch import start_rank_threads
from distframe.optimizers.elastic import ElasticMember
from distframe.optimizers.elastic_rollback import ElasticRollbackError


@dataclasses.dataclass
class Generation:
    """One group of the run: its members (worker ids, rank order), the step it started from, how
    it ended ("clean", "failed" or "finished") and which worker failed."""

    members: list[int]
    start_step: int
    end: str = "finished"
    failed_worker: int | None = None
    error: str | None = None
    results: list[Any] = dataclasses.field(default_factory=list)


class ElasticController:
    """Runs ``worker_fn`` over changing membership (see the module docstring).

    ``initial_world``: members at the start. ``schedule``: {step: world size} for clean leaves
    and joins. ``max_generations`` bounds the run (a worker that fails in every generation).
    ``timeout``: the in-memory backend's timeout per collective, and how long a worker may run
    on after a peer of its generation has ended. ``start_step``: the step the
    first generation starts from (that of the checkpoint its workers restore, when resuming):
    their restore must reach it, as any later generation's must reach the run's newest commit.
    """

    def __init__(self, worker_fn: Callable[[Any, ElasticMember], Any], *, initial_world: int,
                 schedule: dict[int, int] | None = None, max_generations: int = 32,
                 timeout: float = 60.0, start_step: int = 0) -> None:
        for name, value in (("initial_world", initial_world), ("max_generations", max_generations)):
            if not _is_positive_int(value):
                raise ConfigError(f"ElasticController {name}={value!r}: use a positive int")
        for step, size in (schedule or {}).items():
            if not (_is_positive_int(step) and _is_positive_int(size)):
                raise ConfigError(f"ElasticController schedule entry {step!r}: {size!r}: use "
                                  "{step (positive int): world size (positive int)}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"ElasticController timeout={timeout!r}: use a positive number of "
                              "seconds (each collective's limit)")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ConfigError(f"ElasticController start_step={start_step!r}: use an int >= 0")
        self.worker_fn = worker_fn
        self.start_step = start_step
        # The step of the run's newest commit, which every generation is told so that its
        # restore never goes behind it silently (ElasticMember.newest_committed_step).
        self.newest_committed_step = start_step
        self.schedule = dict(sorted((schedule or {}).items()))
        self.max_generations = max_generations
        self.timeout = timeout
        self._next_id = 0
        self.members = [self._new_member() for _ in range(initial_world)]
        self.generations: list[Generation] = []

    def _new_member(self) -> ElasticMember:
        member = ElasticMember(self._next_id)
        self._next_id += 1
        return member

    def run(self) -> list[Generation]:
        """Runs generations until one finishes with no change pending; returns them all."""
        while len(self.generations) < self.max_generations:
            start = max((m.commit.step for m in self.members if m.commit is not None),
                        default=self.newest_committed_step)
            change = next((s for s in self.schedule if s > start), None)
            for m in self.members:
                m.until_step = change
                m.newest_committed_step = self.newest_committed_step
            generation = Generation([m.worker_id for m in self.members], start)
            self.generations.append(generation)
            outcomes = _run_group(self.worker_fn, self.members, self.timeout)
            self._note_newest_commit()
            # A refused restore (on every member alike) or a settings error is not a worker's
            # failure: dropping workers and trying again would meet it again.
            refused = next((o for o in outcomes if isinstance(o, (ElasticRollbackError, ConfigError))), None)
            if refused is not None:
                generation.end, generation.error = "failed", str(refused)
                raise refused
            self._refuse_early_return(outcomes)
            failed = _blamed(outcomes)
            if failed:
                self._drop_failed(generation, outcomes, failed, change)
                continue
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            if errors:
                raise errors[0]
            generation.results = outcomes
            if change is None:
                return self.generations
            generation.end = "clean"
            reached = [m.commit.step if m.commit is not None else -1 for m in self.members]
            if min(reached) < change:
                raise RuntimeError(f"generation ended before step {change} (members reached "
                                   f"{reached}); the worker must train until membership_changes")
            self._resize(self.schedule[change])
        raise RuntimeError(f"elastic run did not finish within {self.max_generations} generations")

    def _drop_failed(self, generation: Generation, outcomes: list[Any], failed: list[int],
                     change: int | None) -> None:
        """Ends a failed generation: drops the failed workers. Where the survivors hold the
        commit of the generation's scheduled change (a worker failed after it), makes that
        change now, as a clean end would have: the next generation starts from that commit and
        looks only for changes after it."""
        generation.end = "failed"
        generation.failed_worker = self.members[failed[0]].worker_id
        generation.error = self._describe_failure(outcomes, failed[0])
        self.members = [m for i, m in enumerate(self.members) if i not in failed]
        if not self.members:
            raise RuntimeError(f"every worker failed; the last error: {generation.error}")
        held = [m.commit.step for m in self.members if m.commit is not None]
        if change is not None and held and max(held) >= change:
            self._resize(self.schedule[change])

    def _resize(self, size: int) -> None:
        """The first ``size`` members stay; new members (holding nothing) make up the rest."""
        self.members = self.members[:size] + [self._new_member() for _ in range(size - len(self.members))]

    def _note_newest_commit(self) -> None:
        """After a generation: its members' newest commit, failed members' included, is the
        run's (it may be of an earlier step than before, after a load by hand that went back).
        Where no member holds one, the run's newest stays what it was."""
        held = [m.commit.step for m in self.members if m.commit is not None]
        if held:
            self.newest_committed_step = max(held)

    def _refuse_early_return(self, outcomes: list[Any]) -> None:
        """A worker that returned while its peers waited for it in a collective (they raise the
        backend's error naming it) is a worker_fn that stopped too soon, not a failure of the
        peers: dropping them would go on with the worker that left."""
        returned = [self.members[i].worker_id for i, o in enumerate(outcomes)
                    if not isinstance(o, (BaseException, Hung))]
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if returned and errors and all(isinstance(e, (CollectiveTimeoutError, RankFailedError))
                                       for e in errors):
            who = f"worker {returned[0]}" if len(returned) == 1 else f"workers {returned}"
            raise RuntimeError(f"{who} returned while the others were still training ({errors[0]}); "
                               "worker_fn must train until optimizer.membership_changes or the end")

    def _describe_failure(self, outcomes: list[Any], rank: int) -> str:
        outcome = outcomes[rank]
        if isinstance(outcome, Hung):
            stopped = next((o for o in outcomes if isinstance(o, CollectiveTimeoutError)), None)
            return (f"worker {self.members[rank].worker_id} hung: it had not returned {outcome.waited:g} s "
                    f"after a peer stopped" + (f" ({stopped})" if stopped is not None else ""))
        if isinstance(outcome, (CollectiveTimeoutError, RankFailedError)):  # named missing by a peer
            peer = next(o for o in outcomes if isinstance(o, CollectiveTimeoutError))
            return f"worker {self.members[rank].worker_id} did not arrive: {peer}"
        return f"{type(outcome).__name__}: {outcome}"


@dataclasses.dataclass(frozen=True)
class Hung:
    """The outcome of a worker thread that had not ended ``waited`` seconds after a peer's had."""

    waited: float


def _blamed(outcomes: list[Any]) -> list[int]:
    """The ranks to drop after a generation: those that raised an error of their own (not the
    backend's report of a peer), else those that hung, else those that the peers' collective
    timeouts name as missing (a slow or stuck rank, not the peers that gave up on it)."""
    raised = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)
              and not isinstance(o, (CollectiveTimeoutError, RankFailedError))]
    if raised:
        return raised
    hung = [i for i, o in enumerate(outcomes) if isinstance(o, Hung)]
    if hung:
        return hung
    return sorted({r for o in outcomes if isinstance(o, CollectiveTimeoutError)
                   for r in (o.missing_ranks or ()) if isinstance(outcomes[r], BaseException)})


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _run_group(worker_fn: Callable[[Any, ElasticMember], Any], members: list[ElasticMember],
               timeout: float) -> list[Any]:
    """Runs ``worker_fn(backend, member)`` on one thread per member over a fresh in-memory group;
    returns each result or exception. A failing rank aborts the group, so none hangs."""
    backends = InMemoryCommunicationBackend.create_group(len(members), timeout=timeout)
    results: list[Any] = [None] * len(members)
    errors: dict[int, BaseException] = {}
    threads = start_rank_threads(backends, lambda b: worker_fn(b, members[b.rank]), results, errors,
                                 "distframe-elastic-rank")
    # [Note: a worker that never returns] Once one worker has ended, the others get ``timeout``
    # seconds more: a peer's failure or departure stops those waiting in a collective at once,
    # and a rank still computing reaches its next collective within that. A thread still alive
    # then is abandoned (a daemon; its group is aborted, so any call it makes later raises).
    deadline = None
    while any(t.is_alive() for t in threads):
        if deadline is None and not all(t.is_alive() for t in threads):
            deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() >= deadline:
            break
        next(t for t in threads if t.is_alive()).join(0.05)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        backends[0].world.abort(hung[0], TimeoutError(f"rank {hung[0]} hung"))
    # A copy: an abandoned thread may still write its slot later.
    return [Hung(timeout) if r in hung else errors.get(r, results[r]) for r in range(len(members))]
