"""``RingDilatedAttention``: dilated attention with the sequence split across ranks.

Layout: with P ranks and a global sequence of T = P * L positions, rank r holds the contiguous
slice ``[r * L, (r + 1) * L)`` of q, k, v (and of ``key_padding_mask``) and receives the same
slice of the output that ``DilatedAttention`` gives on the full sequence. Each head group of
each branch is a unit; a unit whose segments all lie inside every slice (``L % w' == 0``) needs
no communication; any other unit moves only the dilated keys/values its segments need, in one
``all_to_all`` (see ``attention/ring_exchange.py``). Forward and backward are exact (the merged
backward of ``attention/function.py``); the backward repeats the key exchange (rather than keep
remote keys alive between passes) and returns key/value gradients in a second ``all_to_all``.

Memory per rank: the local q, k, v, output and fp32 accumulators, O(L * H * D); plus, for the
one unit in flight, its compressed queries, keys and values, O(min(T, L + 2 w') / r * hg * D)
(the segments that meet the slice, each w'/r rows). Nothing of size T * H * D is formed unless a
segment itself spans the whole sequence with rate 1, where the exact result needs those keys.
"""
from __future__ import annotations

import numbers
import zlib
from typing import Sequence

import torch

from attention.dilated import (DilatedAttention, positive_int, validate_inputs,
                               validate_is_causal)
from attention.function import compressed_key_mask
from attention.plan import SlotPlan, make_slot_plans
from attention.ring_exchange import Routes, exchange_keys, make_routes, return_key_grads


class RingKeySource:
    """Keys of one unit on one rank: local rows plus rows received from their owners."""

    exchanges = True  # its gather communicates: no double backward ([Note: double backward])

    def __init__(self, plan: SlotPlan, routes: Routes, backend, is_causal: bool) -> None:
        self.plan, self.routes, self.backend = plan, routes, backend
        self._missing = plan.missing_keys(is_causal)
        self._exchange = routes.needed

    def gather_keys(self, key, value, key_padding_mask):
        plan, batch, head_dim = self.plan, key.shape[0], key.shape[-1]
        if not self._exchange:
            mask = compressed_key_mask(key_padding_mask, plan, self._missing, batch)
            return plan.compressed(key), plan.compressed(value), mask
        parts = [key, value]
        if key_padding_mask is not None:
            flags = key_padding_mask[:, :, None, None].expand(-1, -1, key.shape[2], 1)
            parts.append(flags.to(key.dtype))
        payload = torch.cat(parts, dim=-1)  # (B, L, H, 2D [+1])
        compressed = plan.compressed(payload).clone()  # (B*nseg, hg, M, 2D [+1])
        flat = compressed.view(batch, -1, payload.shape[-1])  # (B, S, X)
        received = exchange_keys(self.backend, self.routes,
                                 payload.view(batch, -1, payload.shape[-1]))
        for slots, rows in zip(self.routes.recv_slots, received):
            if slots.numel():
                flat.index_copy_(1, slots, rows.transpose(0, 1))
        kc, vc = compressed[..., :head_dim], compressed[..., head_dim:2 * head_dim]
        # Flags travelled with the keys; slots past the sequence are added by the plan.
        flags = (compressed[..., -1] != 0) if key_padding_mask is not None else None
        mask = compressed_key_mask(None, plan, self._missing, batch)
        if flags is not None:
            mask = flags if mask is None else (mask | flags)
        return kc.contiguous(), vc.contiguous(), mask

    def return_key_grads(self, grad_key_c, grad_value_c, grad_key, grad_value):
        plan, batch = self.plan, grad_key.shape[0]
        plan.add_local(grad_key, plan.valid(grad_key_c, batch))
        plan.add_local(grad_value, plan.valid(grad_value_c, batch))
        if not self._exchange:
            return
        head_dim = grad_key.shape[-1]
        both = torch.cat([grad_key_c, grad_value_c], dim=-1).reshape(batch, -1, 2 * head_dim)
        received = return_key_grads(self.backend, self.routes, both)
        for rows, grads in zip(self.routes.send_rows, received):
            if rows.numel():
                grads = grads.transpose(0, 1).to(grad_key.dtype)  # (B, N, 2D)
                grad_key.view(batch, -1, head_dim).index_add_(1, rows, grads[..., :head_dim])
                grad_value.view(batch, -1, head_dim).index_add_(1, rows, grads[..., head_dim:])


# Codes for the agreement check's dtype entry (a dtype not listed is one more code).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "another dtype"


class RingDilatedAttention(DilatedAttention):
    """Sequence-parallel ``DilatedAttention`` over any ``ICommunicationBackend``.

    Each rank passes its ``(B, T / P, H, D)`` slices and gets its slice of the single-device
    output. Collectives: per unit that crosses slice boundaries, one ``all_to_all`` in forward
    and two in backward (keys again, then key gradients); none otherwise; and per forward one
    ``all_gather`` of 10 integers (80 bytes a rank) that checks the ranks' calls agree. Counted in
    ``backend.stats``. Attention dropout is not supported here.

    ``head_start`` and ``total_heads`` are for a rank that holds only some heads (tensor
    parallelism split by heads): the ``H`` heads it passes are heads ``[head_start,
    head_start + H)`` of ``total_heads``, and each reads the positions that head reads in the
    full module. Every rank of ``backend`` must hold the same heads.
    """

    _compiles_to_operator = False  # its keys come from the ring ([Note: dilated attention as an operator])

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 softmax_scale: float | None = None, attention_dropout: float = 0.0, *,
                 backend, head_start: int = 0, total_heads: int | None = None) -> None:
        super().__init__(segment_lengths, dilation_rates, softmax_scale, attention_dropout)
        if attention_dropout != 0.0:
            raise ValueError("attention_dropout: RingDilatedAttention supports only 0.0")
        if total_heads is None and head_start != 0:
            raise ValueError(f"head_start={head_start} needs total_heads (the model's head count) "
                             "to place the heads passed in; or leave head_start at 0")
        if total_heads is not None:  # 0 read "head_start=0 must lie in 0..-1"; floats got in
            total_heads = positive_int("total_heads", total_heads)
            if (isinstance(head_start, bool) or not isinstance(head_start, numbers.Integral)
                    or not 0 <= head_start < total_heads):
                raise ValueError(f"head_start must be an integer in 0..{total_heads - 1} (below "
                                 f"total_heads), got {head_start!r}")
            head_start = int(head_start)
        self.backend = backend
        # Head-split (tensor-parallel) use: the H heads passed in are heads
        # [head_start, head_start + H) of total_heads, and read what those heads read.
        self.head_start, self.total_heads = head_start, total_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's ``(B, T / P, H, D)`` slices -> its slice of the output."""
        if self.training and self.attention_dropout != 0.0:  # set after construction
            raise ValueError(f"attention_dropout={self.attention_dropout}: RingDilatedAttention supports "
                             "only 0.0 (its dropout path would drop the gradients of other ranks' keys); "
                             "set it back to 0.0, or call eval()")
        validate_is_causal(is_causal)
        validate_inputs(query, key, value, key_padding_mask)
        self._check_ranks_agree(query, is_causal, key_padding_mask)
        return super().forward(query, key, value, is_causal, key_padding_mask)

    def _check_ranks_agree(self, query: torch.Tensor, is_causal: bool,
                           key_padding_mask: torch.Tensor | None) -> None:
        """One ``all_gather`` of 10 integers per forward: every rank must pass slices of one
        shape and dtype, hold the same heads, agree on ``is_causal`` and on having a mask, and be
        built with the same branches and scale, as every rank derives every route from its own
        call and module. Checked on every call, not once per shape:
        a rank whose shape was cached skipped the check while a rank with a new one made it, so
        slices of unequal lengths after equal ones (the last, shorter batch cut by
        ``torch.chunk``) mismatched the collectives: Gloo aborted the process ("Received data
        size doesn't match"). Ranks holding other heads met matching collectives and returned
        wrong results without a word."""
        batch, local_len, heads, head_dim = query.shape
        total = heads if self.total_heads is None else self.total_heads
        dtype = _DTYPES.index(query.dtype) if query.dtype in _DTYPES else len(_DTYPES)
        mine = torch.tensor([batch, local_len, heads, head_dim, int(is_causal),
                             int(key_padding_mask is not None), self.head_start, total, dtype,
                             self._branches_digest()], device=query.device)
        calls = self.backend.all_gather(mine).view(-1, mine.numel()).tolist()
        lengths = [call[1] for call in calls]
        if len(set(lengths)) > 1:
            raise ValueError(f"RingDilatedAttention needs slices of one length on every rank, got "
                             f"{lengths} on ranks 0..{len(lengths) - 1}: pad the sequence to a "
                             "multiple of the world size (masking the padding with "
                             "key_padding_mask) and split it into equal slices")
        if any(call[9] != calls[0][9] for call in calls):
            raise ValueError("RingDilatedAttention needs every rank to use the same segment_lengths, "
                             "dilation_rates and softmax_scale (each derives its routes from its "
                             f"own); this rank ({self.backend.rank}) has {self._branches()}: build "
                             "every rank's module with the same ones")
        if any(call[6:8] != calls[0][6:8] for call in calls):
            described = "; ".join(f"rank {rank}: heads [{call[6]}, {call[6] + call[2]}) of {call[7]}"
                                  for rank, call in enumerate(calls))
            raise ValueError("RingDilatedAttention needs every rank to hold the same heads "
                             f"(head_start, total_heads); got {described}")
        if any(call != calls[0] for call in calls):
            described = "; ".join(
                f"rank {rank}: (batch, heads, head_dim) = {tuple(call[0:1] + call[2:4])}, "
                f"{_dtype_name(call[8])}, is_causal={bool(call[4])}, "
                f"key_padding_mask {'given' if call[5] else 'None'}"
                for rank, call in enumerate(calls))
            raise ValueError("RingDilatedAttention needs every rank to pass the same batch, heads, "
                             "head_dim and dtype, the same is_causal, and a key_padding_mask on all "
                             f"ranks or none; got {described}")

    def _branches(self) -> str:
        return (f"segment_lengths={list(self.segment_lengths)}, dilation_rates="
                f"{list(self.dilation_rates)}, softmax_scale={self.softmax_scale}")

    def _branches_digest(self) -> int:
        """The branches and scale as one integer, equal on ranks built alike (crc32, not
        ``hash``: that of None differs between processes before Python 3.12)."""
        return zlib.crc32(self._branches().encode())

    def _key_sources(self, local_len: int, num_heads: int, device, is_causal: bool):
        """``DilatedAttention.forward`` runs unchanged on this rank's slices: the sources it
        asks for here read keys and values from the whole ring."""
        world, rank = self.backend.world_size, self.backend.rank
        # Everything the sources are built from, the backend they exchange over included (a
        # context-parallel model assigns ``backend`` after construction): a module changed after
        # a forward builds new ones instead of reusing the old layout, or the old group.
        # (The id cannot be reused while cached: the sources hold the backend.)
        cache_key = ("ring", local_len, num_heads, str(device), is_causal, world, rank, id(self.backend),
                     self._branches(), self.head_start, self.total_heads)
        if cache_key in self._sources:
            return self._sources[cache_key]
        total, heads = num_heads, None
        if self.total_heads is not None:  # make_slot_plans checks that the heads fit
            total, heads = self.total_heads, (self.head_start, self.head_start + num_heads)
        seq_len, sources = local_len * world, []
        for w, r in zip(self.segment_lengths, self.dilation_rates):
            plans = make_slot_plans(seq_len=seq_len, start=rank * local_len,
                                    stop=(rank + 1) * local_len, segment_length=w,
                                    dilation_rate=r, num_heads=total, heads=heads, device=device)
            for index, plan in enumerate(plans):
                routes = make_routes(seq_len=seq_len, world_size=world, rank=rank,
                                     segment_length=w, dilation_rate=r, num_heads=total,
                                     group_index=index, is_causal=is_causal, heads=heads,
                                     device=device)
                sources.append(RingKeySource(plan, routes, self.backend, is_causal))
        self._sources[cache_key] = sources
        return sources
