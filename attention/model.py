"""``DilatedTransformerLM``: the decoder-only byte-level language model the main job trains.

Layout (names are a contract for the pipeline splitter and tensor-parallel plans):
``tok_embedding`` -> ``pos_embedding`` added -> ``blocks`` (an ``nn.ModuleList`` of pre-norm
``attn`` = ``MultiheadDilatedAttention`` and ``mlp`` = ``fc_in``/``fc_out``) -> ``final_norm``
-> ``head``. Attention is causal. A plain single-device ``nn.Module``: strategies wrap it.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from attention.multihead import MultiheadDilatedAttention
from attention.positions import shard_positions
from attention.recompute import checkpoint_with_same_masks
from attention.uncompiled import UncompiledDilatedAttention

try:  # the project's error type when it is there; a ValueError either way
    from distframe.errors import ConfigError
except ImportError:  # pragma: no cover - attention also works on its own
    ConfigError = ValueError  # type: ignore[misc,assignment]


def _positive_int(name: str, value, *, entry: bool = False) -> int:
    """``value`` as an ``int`` if it is a positive integer (numpy integers too; not a bool);
    ``entry``: it is one entry of the field ``name``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number <= 0:
        what = "hold positive integers" if entry else "be a positive integer"
        raise ConfigError(f"{name} must {what}, got {value!r}")
    return number


@dataclass(frozen=True, kw_only=True)
class DilatedTransformerConfig:
    """Model shape. Validated on construction; errors name the field."""

    vocab_size: int = 256
    seq_len: int = 1024
    embed_dim: int = 256
    num_heads: int = 4
    num_layers: int = 4
    mlp_ratio: int = 4
    segment_lengths: tuple[int, ...] = (256, 512, 1024)
    dilation_rates: tuple[int, ...] = (1, 2, 4)
    dropout: float = 0.0
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        # Integers are checked as integers: a float seq_len failed inside nn.Embedding, and
        # num_layers=True built one layer.
        for name in ("segment_lengths", "dilation_rates"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
                raise ConfigError(f"{name} must be a sequence of positive integers (one per "
                                  f"branch), got {values!r}")
            object.__setattr__(self, name, tuple(_positive_int(name, v, entry=True)
                                                for v in values))
        for name in ("vocab_size", "seq_len", "embed_dim", "num_heads", "num_layers",
                     "mlp_ratio"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
            # eps <= 0 or NaN gave NaN logits without an error
            raise ConfigError(f"layer_norm_eps must be a positive finite number, got {eps!r}")
        if self.embed_dim % self.num_heads != 0:
            raise ConfigError(f"embed_dim ({self.embed_dim}) must be divisible by num_heads "
                              f"({self.num_heads})")
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"dropout must be a number in [0, 1), got {dropout!r}")
        for name in ("tie_embeddings", "activation_checkpointing"):  # "false" would be truthy
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._validate_branches()

    def _validate_branches(self) -> None:
        if len(self.segment_lengths) == 0 or len(self.segment_lengths) != len(self.dilation_rates):
            raise ConfigError("segment_lengths and dilation_rates must be non-empty and of equal "
                              f"length, got {self.segment_lengths} and {self.dilation_rates}")
        for w, r in zip(self.segment_lengths, self.dilation_rates):
            if w > self.seq_len:
                raise ConfigError(f"segment_lengths: {w} exceeds seq_len {self.seq_len}; use "
                                  f"segments no longer than the sequence")
            if w % r != 0:
                raise ConfigError(f"segment_lengths: {w} is not divisible by its dilation rate {r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "DilatedTransformerConfig":
        """``"tiny"`` (tests, seconds on CPU) or ``"small"`` (the main job); fields may be overridden."""
        presets = {
            "tiny": dict(seq_len=64, embed_dim=32, num_heads=2, num_layers=2,
                         segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4)),
            "small": dict(seq_len=1024, embed_dim=256, num_heads=4, num_layers=4,
                          segment_lengths=(256, 512, 1024), dilation_rates=(1, 2, 4)),
        }
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    def replace(self, **changes) -> "DilatedTransformerConfig":
        return dataclasses.replace(self, **changes)


class MLP(nn.Module):
    def __init__(self, config: DilatedTransformerConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.embed_dim
        self.fc_in = nn.Linear(config.embed_dim, hidden)
        self.activation = nn.GELU()
        self.fc_out = nn.Linear(hidden, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.activation(self.fc_in(x))))


def draws_from_own_generators(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` names a generator of its own for its dropout (overrides
    ``dropout_generator``: dilated attention's returns None, torch's global one); traceable by
    Dynamo ([Note: activation checkpointing under torch.compile] in attention/recompute.py)."""
    base = UncompiledDilatedAttention.dropout_generator
    return any(getattr(type(sub), "dropout_generator", base) is not base for sub in module.modules())


class DilatedTransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln_attn(x))``, then ``x + mlp(ln_mlp(x))``; causal. With
    ``activation_checkpointing`` (training, with grad) it keeps only its input and recomputes the
    rest in backward, with the same dropout masks ([Note: activation checkpointing] in
    ``attention/recompute.py``)."""

    def __init__(self, config: DilatedTransformerConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.attn = MultiheadDilatedAttention(
            config.embed_dim, config.num_heads, segment_lengths=config.segment_lengths,
            dilation_rates=config.dilation_rates, dropout=config.dropout,
            layer_norm_eps=config.layer_norm_eps)
        self.ln_mlp = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_checkpointing = config.activation_checkpointing

    def forward(self, x: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, E)
        """``key_padding_mask``: ``(B, T)`` bool, True = a key the attention ignores. Keyword-only
        and optional, so pipeline stages keep calling ``block(x)``."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            if torch.compiler.is_compiling() and not draws_from_own_generators(self):
                # [Note: activation checkpointing under torch.compile]: traced whole
                return checkpoint(self._forward, x, key_padding_mask, use_reentrant=False)
            return checkpoint_with_same_masks(self, self._forward, x, key_padding_mask)
        return self._forward(x, key_padding_mask)

    def _forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_attn(x)
        attended, _ = self.attn(h, h, h, is_causal=True, key_padding_mask=key_padding_mask)
        x = x + self.dropout(attended)
        return x + self.mlp(self.ln_mlp(x))


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """Token ids are int64 or int32 (else ValueError) in ``[0, vocab_size)`` (else IndexError),
    where nn.Embedding failed in torch's words. The range is checked on CPU only: on a GPU it
    would cost a synchronisation per forward (there an id out of range is a device-side
    assertion)."""
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must hold int64 or int32 token ids, got {tokens.dtype}: convert them "
                         "with .long()")
    if tokens.device.type == "cpu" and tokens.numel():
        if torch.compiler.is_compiling():  # a graph cannot branch on the ids: an assertion op
            torch._assert_async(((tokens >= 0) & (tokens < vocab_size)).all(),
                                f"DilatedTransformerLM got token ids outside its vocabulary "
                                f"[0, {vocab_size}) (the config's vocab_size)")
            return
        low, high = torch.aminmax(tokens)
        if low < 0 or high >= vocab_size:  # IndexError, as nn.Embedding's and VocabParallelEmbedding's
            raise IndexError(f"DilatedTransformerLM got token ids in [{int(low)}, {int(high)}], outside "
                             f"its vocabulary [0, {vocab_size}) (the config's vocab_size)")


def check_key_padding_mask(mask: object, tokens: torch.Tensor) -> None:
    """ValueError unless ``mask`` is a bool tensor shaped as ``tokens`` on their device. Checked
    here, in the LM's words: the attention layers would refuse it too, but name the attention's
    shapes, and an integer mask is most likely a Hugging Face ``attention_mask`` (1 = keep), the
    inverse of this one."""
    expected = (f"key_padding_mask must be a bool tensor of shape (batch, seq) = {tuple(tokens.shape)}, "
                "True marking padding")
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{expected}; got {type(mask).__name__}: convert it with torch.as_tensor(...)")
    if mask.dtype != torch.bool:
        hint = (" (an additive 0/-inf mask: pass mask == -inf)" if mask.is_floating_point() else
                " (a Hugging Face attention_mask, 1 = keep, is the inverse: pass attention_mask == 0)")
        raise ValueError(f"{expected}; got {mask.dtype}{hint}")
    if mask.shape != tokens.shape:
        raise ValueError(f"{expected}; got shape {tuple(mask.shape)}")
    if mask.device != tokens.device:
        raise ValueError(f"key_padding_mask is on {mask.device} but the tokens are on {tokens.device}: "
                         "move it with .to(tokens.device)")


class DilatedTransformerLM(nn.Module):
    """Byte-level decoder-only LM: ``tokens (B, T) int64 -> logits (B, T, vocab)``, causal."""

    def __init__(self, config: DilatedTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_embedding = nn.Embedding(config.seq_len, config.embed_dim)
        self.blocks = nn.ModuleList(DilatedTransformerBlock(config)
                                    for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        nn.init.normal_(self.tok_embedding.weight, std=0.02)
        nn.init.normal_(self.pos_embedding.weight, std=0.02)
        if config.tie_embeddings:
            self.head.weight = self.tok_embedding.weight
        self.sequence_shard = (0, 1)
        """``(index, count)``: the tokens passed are slice ``index`` of ``count`` equal slices of
        the sequence (context parallelism sets it), so their positions start at ``index * T``."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T) int64 -> (B, T, E)``: token plus learned position embeddings."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got {tuple(tokens.shape)}")
        check_token_ids(tokens, self.config.vocab_size)
        positions = shard_positions(tokens, self.sequence_shard, self.config.seq_len)
        return self.tok_embedding(tokens) + self.pos_embedding(positions)

    def forward(self, tokens: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens (B, T)`` -> logits ``(B, T, vocab)``, causal.

        ``key_padding_mask``: ``(B, T)`` bool, True marking a padding token (as
        ``nn.MultiheadAttention``'s; the inverse of a Hugging Face ``attention_mask``), or None
        for no padding. Every attention layer ignores the keys it marks. It hides keys only:
        positions stay ``0 .. T-1`` whatever the padding, and padded positions still get logits,
        which mean nothing (leave them out of the loss). Right padding, what training uses, gives
        each sequence the logits it gets run alone (equal to rounding); there, causal attention never
        reads a later key, so the mask changes nothing for unpadded positions. Left padding (or
        padding anywhere) needs the mask: with it no unpadded position reads a padded token, but
        each token keeps its padded position, and so its segments: its logits are those of the
        sequence placed at that offset, not those of the sequence run alone. A query that sees
        only padded keys (a fully padded row, left padding's pads) attends to nothing and gets a
        zero attention output, finite. The strategies that run the LM's layers themselves
        (pipeline stages, through ``pipeline_layers``) take no mask.
        """
        x = self.embed(tokens)  # (B, T, E)
        if key_padding_mask is not None:
            check_key_padding_mask(key_padding_mask, tokens)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)
        return self.head(self.final_norm(x))  # (B, T, V)
