"""Pipeline schedules: the order in which one stage runs forward and backward micro-batches.

Pure functions of ``(num_stages, stage, num_microbatches)``; the runtime executes the list.

* GPipe: every forward, then every backward. A stage holds all ``m`` micro-batches' activations
  at the peak.
* 1F1B (PipeDream-flush): ``p - s - 1`` warm-up forwards, then alternate one forward and one
  backward, then drain the backwards. Stage s holds at most ``p - s`` micro-batches in flight.

Both have the same bubble, ``(p - 1) / (m + p - 1)`` of the step when every stage costs the same.
Every send of one stage is matched by a receive of its neighbour in the same order, so with
non-blocking sends neither schedule can deadlock.
"""
from __future__ import annotations

import dataclasses

from distframe.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Action:
    """``kind`` ``"F"`` (forward) or ``"B"`` (backward) of micro-batch ``microbatch``."""

    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    _check(num_stages, stage, num_microbatches)
    return ([Action("F", i) for i in range(num_microbatches)]
            + [Action("B", i) for i in range(num_microbatches)])


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    _check(num_stages, stage, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < num_microbatches:
        actions += [Action("F", forward), Action("B", backward)]
        forward, backward = forward + 1, backward + 1
    actions += [Action("B", i) for i in range(backward, num_microbatches)]
    return actions


def schedule_actions(name: str, num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """The action list of ``stage`` under schedule ``name`` (``"gpipe"`` or ``"1f1b"``)."""
    if name == "gpipe":
        return gpipe(num_stages, stage, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(num_stages, stage, num_microbatches)
    raise ConfigError(f"schedule={name!r}: choose one of {', '.join(SCHEDULES)}")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward has not (activations held)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _check(num_stages: int, stage: int, num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be positive, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ConfigError(f"stage {stage} is outside 0..{num_stages - 1}")
