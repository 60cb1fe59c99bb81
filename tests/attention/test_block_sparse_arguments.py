"""BlockSparseDilatedAttention's block counts are integers: anything else is refused, naming the
argument, where floats used to change the pattern silently."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attention import BlockSparseDilatedAttention


@pytest.mark.parametrize("kwargs,name", [
    (dict(block_size=4.0, local_window=1), "block_size"),     # failed inside torch.zeros
    (dict(block_size=4, local_window=1.5), "local_window"),   # a window of 1, silently
    (dict(block_size=4, segment_blocks=2.0), "segment_blocks"),
    (dict(block_size=4, segment_blocks=2, dilation=1.5), "dilation"),  # blocks 3 apart, silently
    (dict(block_size=4, global_blocks=0.5), "global_blocks"),  # one global block, silently
    (dict(block_size=True, local_window=1), "block_size"),
    (dict(block_size=None, local_window=1), "block_size"),
    (dict(block_size=4, local_window=-1), "local_window"),
    (dict(block_size=4, segment_blocks=0), "segment_blocks"),
    (dict(block_size=4, local_window=1, dilation=0), "dilation"),
])
def test_block_counts_that_are_not_integers_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be a (positive|non-negative) integer"):
        BlockSparseDilatedAttention(**kwargs)


def test_numpy_integers_give_the_layout_of_python_ints():
    kwargs = dict(local_window=1, segment_blocks=4, dilation=2, global_blocks=1)
    ours = BlockSparseDilatedAttention(np.int64(4), **{k: np.int32(v) for k, v in kwargs.items()})
    ref = BlockSparseDilatedAttention(4, **kwargs)
    assert torch.equal(ours.layout(8, 2, True), ref.layout(8, 2, True))
    assert all(type(getattr(ours, k)) is int for k in ("block_size", *kwargs))
