"""Attention dropout decided per (batch, head, query, key) pair by a counter-based hash.

[Note: one dropout decision per pair]
Dropout acts on the *merged* attention probabilities, as dense attention with dropout on its
softmax: pair (b, h, i, j) is kept with probability ``1 - p`` and then scaled by ``1 / (1 - p)``.
A key that several dilated branches cover for one query is one entry of the merged matrix, so
every branch holding the pair must make the same decision: each branch computes it from
``hash(seed, b, h, i, j)`` (global head index and global positions) instead of drawing its own.
Nothing of size (T, T) is formed: a branch hashes only the pairs of its own compressed segments.

The seed is two 32-bit words drawn from the module's generator once per forward, so generator
states reproduce masks as before. The hash works on 32-bit words held in int64 (every product of
a word and a multiplier below 2**31 fits, so nothing overflows): a row word chained from the
seed, batch, head and query position, a key word from the key position, and the pair word
``mix(row ^ key)``; the pair is kept iff that word is below ``(1 - p) * 2**32``. ``mix`` is a
bijection of 32-bit words (xor-shifts and odd multipliers).
"""
from __future__ import annotations

import torch

from attention.plan import SlotPlan

_WORD = 0xFFFFFFFF
_MULTIPLIERS = (0x5BD1E995, 0x27D4EB2D)  # odd and below 2**31
_KEY_SALT = 0x9E3779B9  # keeps key words apart from the row chain
_CHUNK = 1 << 17  # pairs hashed per step: the int64 scratch stays in cache


def _mix(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Mixes the 32-bit words of int64 ``x`` in place and returns it."""
    scratch = torch.empty_like(x) if scratch is None else scratch
    for shift, multiplier in zip((16, 15), _MULTIPLIERS):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))
        x.mul_(multiplier).bitwise_and_(_WORD)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Two random 32-bit words (int64, on the generator's device, or ``device`` when None)."""
    where = device if generator is None else generator.device
    return torch.randint(0, _WORD + 1, (2,), generator=generator, device=where)


def row_words(seed: torch.Tensor, batch: torch.Tensor, head: torch.Tensor,
              query: torch.Tensor) -> torch.Tensor:
    """The word of every (batch, head, query position) row; the int64 arguments broadcast."""
    word = _mix(seed[0].clone())
    for counter in (seed[1], batch, head, query):
        word = _mix((word ^ counter.to(word.device)) & _WORD)
    return word


def key_words(key: torch.Tensor) -> torch.Tensor:
    """The word of every key position (int64)."""
    return _mix((key.to(torch.int64) ^ _KEY_SALT) & _WORD)


def keep_pairs(rows: torch.Tensor, keys: torch.Tensor, p: float) -> torch.Tensor:
    """``(U, M)`` row words and ``(U, N)`` key words -> ``(U, M, N)`` bool: pair kept."""
    threshold = round((1.0 - p) * (_WORD + 1))
    units, num_rows, num_keys = rows.shape[0], rows.shape[1], keys.shape[1]
    keep = torch.empty(units, num_rows, num_keys, dtype=torch.bool, device=rows.device)
    if keep.numel() == 0:
        return keep
    unit_step = max(1, _CHUNK // max(num_rows * num_keys, 1))
    row_step = num_rows if unit_step > 1 else max(1, _CHUNK // num_keys)
    buffers = [torch.empty(min(unit_step, units) * min(row_step, num_rows) * num_keys,
                           dtype=torch.int64, device=rows.device) for _ in range(2)]
    for u in range(0, units, unit_step):
        for r in range(0, num_rows, row_step):
            block = rows[u:u + unit_step, r:r + row_step, None]  # (u, r, 1)
            shape = (block.shape[0], block.shape[1], num_keys)
            words, scratch = (b[:shape[0] * shape[1] * num_keys].view(shape) for b in buffers)
            torch.bitwise_xor(block, keys[u:u + unit_step, None, :], out=words)
            torch.lt(_mix(words, scratch), threshold,
                     out=keep[u:u + unit_step, r:r + row_step])
    return keep


def unit_keep_mask(plan: SlotPlan, batch: int, seed: torch.Tensor, first_head: int,
                   p: float) -> torch.Tensor:
    """``(B*nseg, hg, M, M)`` bool: the decisions of one unit's compressed (query, key) pairs;
    ``first_head`` is the global index of local head 0 (a head-split rank's first head)."""
    positions = plan.slot_positions.to(seed.device)  # (nseg, hg, M): queries' and keys' alike
    heads = torch.arange(plan.head_start, plan.head_stop, device=seed.device) + first_head
    batches = torch.arange(batch, device=seed.device).view(-1, 1, 1, 1)
    rows = row_words(seed, batches, heads.view(1, 1, -1, 1), positions)  # (B, nseg, hg, M)
    keys = key_words(positions).expand_as(rows)
    keep = keep_pairs(rows.reshape(-1, plan.rows), keys.reshape(-1, plan.rows), p)
    return keep.view(batch * plan.num_segments, plan.group_heads, plan.rows, plan.rows)
