"""Shared helpers for the attention tests: random inputs and comparison of outputs and grads."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def tiny_lm_config(**overrides):
    """The tiny LM the compile tests build: 32 tokens, three branches."""
    from attention.model import DilatedTransformerConfig
    return DilatedTransformerConfig.preset("tiny", vocab_size=64, seq_len=32, segment_lengths=(8, 16, 32),
                                           dilation_rates=(1, 2, 4), **overrides)


def random_qkv(batch, seq, heads, dim, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, heads, dim, dtype=dtype, generator=generator)
            .requires_grad_() for _ in range(3)]


def outputs_and_grads(fn, tensors, grad_out):
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, grad_out)
    return out, grads


def max_error(a, b):
    if isinstance(a, (tuple, list)):
        return max(max_error(x, y) for x, y in zip(a, b))
    return (a.double() - b.double()).abs().max().item()


def copy_weights(ours, theirs) -> None:
    """``theirs`` (an nn.MultiheadAttention) gets ``ours``'s (a MultiheadDilatedAttention)
    projections, after drawing random biases for ours, so a bias handled wrongly shows."""
    with torch.no_grad():
        for proj in (ours.q_proj, ours.k_proj, ours.v_proj):
            proj.bias.normal_()
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight,
                                               ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias,
                                             ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)


class NewStoragePeak(TorchDispatchMode):
    """Peak bytes of live storages that ops run inside it create, each storage once (views of
    one count once); the storages of ``existing`` tensors (kept alive by the caller) are left out."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                known = self.live.get(key)
                if key not in self.existing and (known is None or known[0].expired()):
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current = sum(size for ref, size in self.live.values() if not ref.expired())
        self.peak = max(self.peak, self.current)
        return out
