"""Pipeline schedules: the order in which one stage runs forward and backward micro-batches.

Pure functions of ``(num_stages, stage, num_microbatches)``; the runtime executes the list.

* GPipe: every forward, then every backward. A stage holds all ``m`` micro-batches' activations
  at the peak.
* 1F1B (PipeDream-flush): ``p - s - 1`` warm-up forwards, then alternate one forward and one
  backward, then drain the backwards. Stage s holds at most ``p - s`` micro-batches in flight.
* Interleaved 1F1B (Megatron, Narayanan et al. 2021): each rank holds ``v`` model chunks (global
  stage ``c * p + r`` is chunk c of rank r); forwards visit the chunks in rounds of ``p``
  micro-batches, backwards in reverse chunk order; ``m`` must be a multiple of ``p``. The bubble
  shrinks to ``(p - 1) / (v * m + p - 1)`` for the price of ``v`` times more messages.

GPipe and 1F1B have the same bubble, ``(p - 1) / (m + p - 1)`` of the step when every stage costs
the same. Every send of one stage is matched by a receive of its neighbour in the same order, so
with non-blocking sends no schedule here can deadlock (the tests simulate each one to check).
"""
from __future__ import annotations

import dataclasses

from distframe.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class Action:
    """``kind`` ``"F"`` (forward) or ``"B"`` (backward) of micro-batch ``microbatch`` on this
    rank's model chunk ``chunk`` (always 0 without interleaving)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


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


def interleaved_one_f_one_b(num_ranks: int, rank: int, num_microbatches: int,
                            num_chunks: int) -> list[Action]:
    _check(num_ranks, rank, num_microbatches)
    p, v, m = num_ranks, num_chunks, num_microbatches
    if m % p:
        raise ConfigError(f"interleaved_1f1b runs micro-batches in rounds of the pipeline size: "
                          f"num_microbatches={m} must be a multiple of pp={p}")

    def forward_slot(k: int) -> tuple[int, int]:  # (chunk, micro-batch) of this rank's k-th forward
        round_, within = divmod(k, p * v)
        return within // p, round_ * p + within % p

    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [Action("F", forward_slot(k)[1], forward_slot(k)[0]) for k in range(warmup)]
    forward, backward = warmup, 0

    def next_backward(k: int) -> Action:
        chunk, microbatch = forward_slot(k)
        return Action("B", microbatch, v - 1 - chunk)

    while forward < total:
        chunk, microbatch = forward_slot(forward)
        actions += [Action("F", microbatch, chunk), next_backward(backward)]
        forward, backward = forward + 1, backward + 1
    actions += [next_backward(k) for k in range(backward, total)]
    return actions


def schedule_actions(name: str, num_stages: int, stage: int, num_microbatches: int,
                     num_chunks: int = 1) -> list[Action]:
    """The action list of pipeline rank ``stage`` under schedule ``name`` (``"gpipe"``,
    ``"1f1b"`` or ``"interleaved_1f1b"`` with ``num_chunks`` model chunks per rank)."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r}: choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(num_stages, stage, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ConfigError(f"virtual_stages={num_chunks} needs schedule='interleaved_1f1b'")
    if name == "gpipe":
        return gpipe(num_stages, stage, num_microbatches)
    return one_f_one_b(num_stages, stage, num_microbatches)


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward has not (activations held)."""
    live = peak = 0
    for action in actions:  # (micro-batch, chunk) pairs: each chunk's activations count
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _check(num_stages: int, stage: int, num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be positive, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ConfigError(f"stage {stage} is outside 0..{num_stages - 1}")
