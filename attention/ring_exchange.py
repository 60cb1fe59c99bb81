"""Communication for ``RingDilatedAttention``: moving dilated keys and values between ranks.

For one unit (head group of a branch) rank j needs, for every segment that meets its slice, the
keys of that segment selected for the group (``attention/plan.py``). Keys that another rank
owns travel in one ``all_to_all``: rank i sends rank j exactly the selected keys (and values,
and key-padding flags) of its slice that j's segments use, and nothing else (LongNet's scheme,
without gathering whole sequences). Under causality keys after j's slice are not sent. The
backward sends the gradients of those keys back along the reverse routes, again one
``all_to_all``. Every rank derives every route from the shapes alone, so no metadata moves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.plan import SlotPlan, make_slot_plans


@dataclass(frozen=True)
class Routes:
    """Index lists of one unit on one rank: what it receives from and sends to every rank."""

    recv_slots: list[torch.Tensor]  # [i]: flat slots of my compressed keys filled by rank i
    send_rows: list[torch.Tensor]  # [j]: flat (T_local * H) rows of my keys rank j needs
    needed: bool  # some rank of the group receives something: every rank joins the all_to_all


def _remote_slots(plan: SlotPlan, local_len: int, owner: int, is_causal: bool) -> torch.Tensor:
    """Flat slots of ``plan`` holding keys owned by rank ``owner`` (not by the plan's rank)."""
    pos = plan.slot_positions.reshape(-1)
    keep = (pos < plan.seq_len) & (pos // local_len == owner)
    keep &= (pos < plan.start) | (pos >= plan.stop)
    if is_causal:
        keep &= pos < plan.stop
    return torch.nonzero(keep).flatten()


def make_routes(*, seq_len: int, world_size: int, rank: int, segment_length: int,
                dilation_rate: int, num_heads: int, group_index: int, is_causal: bool,
                heads: tuple[int, int] | None = None, device=None) -> Routes:
    """Routes of head group ``group_index`` of one branch (of the plans ``make_slot_plans``
    makes with the same ``num_heads`` and ``heads``), for ``rank``."""
    local_len = seq_len // world_size

    def plan_of(r: int) -> SlotPlan:
        return make_slot_plans(seq_len=seq_len, start=r * local_len, stop=(r + 1) * local_len,
                               segment_length=segment_length, dilation_rate=dilation_rate,
                               num_heads=num_heads, heads=heads, device=device)[group_index]

    mine = plan_of(rank)
    recv = [_remote_slots(mine, local_len, i, is_causal) for i in range(world_size)]
    send, needed = [], False
    for j in range(world_size):
        theirs = plan_of(j)
        needed = needed or any(_remote_slots(theirs, local_len, i, is_causal).numel()
                               for i in range(world_size))
        slots = _remote_slots(theirs, local_len, rank, is_causal)
        positions = theirs.slot_positions.reshape(-1)[slots]
        held = theirs.head_start + (slots // theirs.rows) % theirs.group_heads
        send.append((positions - mine.start) * mine.num_heads + held)  # rows of my slice
    return Routes(recv_slots=recv, send_rows=send, needed=needed)


def exchange_keys(backend, routes: Routes, payload: torch.Tensor) -> list[torch.Tensor]:
    """``payload (B, T_local*H, X)``: send rank j its rows; returns ``(N_i, B, X)`` from each i."""
    chunks = [payload.index_select(1, rows).transpose(0, 1).contiguous()
              for rows in routes.send_rows]  # (N_j, B, X)
    return backend.all_to_all(chunks)


def return_key_grads(backend, routes: Routes, grads_c: torch.Tensor) -> list[torch.Tensor]:
    """``grads_c (B, S, X)`` compressed; sends rank i its slots; returns ``(N_j, B, X)`` from j."""
    chunks = [grads_c.index_select(1, slots).transpose(0, 1).contiguous()
              for slots in routes.recv_slots]
    return backend.all_to_all(chunks)
