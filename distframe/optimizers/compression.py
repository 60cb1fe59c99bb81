"""Gradient compressors: the math of turning one gradient into a smaller payload and back.

A compressor is a two-method plug-in, as in Horovod: ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor``. ``payload`` is a tuple of tensors (what goes on the wire),
``ctx`` is whatever this rank needs to undo the compression (shape, dtype) and never leaves it.
No communication happens here: ``GradientCompressionOptimizer`` (``compressed.py``) moves the
payloads, and each compressor's ``exchange`` says how the ranks' payloads combine:

``"all_reduce"``  payloads add up elementwise, so ``decompress(sum of payloads)`` is the sum of
                  the gradients as each rank sent them (identity, fp16, bf16);
``"all_gather"``  payloads cannot be added (per-rank scales, per-rank indices): every rank's
                  payload is gathered and decompressed, and the results are summed in rank order
                  (int8, top-k);
``"powersgd"``    two all_reduces with an orthogonalisation between them (PowerSGD's own
                  methods ``project``, ``orthogonalize``, ``back_project``, ``approximate``).

``lossy`` compressors lose information (the optimizer keeps an error-feedback residual); stateful
ones key their state by ``key``, the parameter's name: ``state_dict()`` keys are ``"<what>/<key>"``
(``"<what>/"``: the whole compressor's), and a load hands ``load_state_dict`` every saved entry."""
from __future__ import annotations

import abc
import math
import zlib
from typing import Any

import torch

from distframe.errors import ConfigError

Payload = tuple[torch.Tensor, ...]

# [Note: int8 range] Symmetric quantization onto -127..127 (not -128) keeps zero exact and the
# two signs alike, so deterministic rounding is an odd function and stochastic rounding unbiased.
_INT8_LEVELS = 127


class Compressor(abc.ABC):
    """``compress(tensor, key=None) -> (payload, ctx)`` and ``decompress(payload, ctx)``."""

    #: how ranks' payloads combine: "all_reduce", "all_gather" or "powersgd" (see module doc)
    exchange = "all_reduce"
    #: whether decompress(compress(t)) may differ from t (error feedback applies when True)
    lossy = True

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        """The wire payload for ``tensor`` and the local context to undo it."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """A tensor of the original shape and dtype."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def __getstate__(self) -> dict[str, Any]:  # a copy (deepcopy, pickle) serves no rank yet: claim
        return {key: value for key, value in self.__dict__.items() if key != "_holder"}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:  # noqa: B027 - optional
        """Restores what ``state_dict`` returned (stateless compressors ignore it)."""

    def bind(self, rank: int) -> None:  # noqa: B027 - optional
        """Called by GradientCompressionOptimizer with the rank that will use this compressor."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IdentityCompressor(Compressor):
    """Sends the gradient as it is: the optimizer then reduces exactly as DDP does."""

    lossy = False

    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        return (tensor,), None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]


class _CastCompressor(Compressor):
    """Casts to a narrower floating dtype for the wire and back to the gradient's dtype."""

    wire_dtype: torch.dtype

    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        return (tensor.to(self.wire_dtype),), tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx)


class FP16Compressor(_CastCompressor):
    """IEEE half precision on the wire (2 bytes an element). GradientCompressionOptimizer has
    each rank send its share of the mean (see [Note: shares on the wire] in ``compressed.py``), so
    the sum over ranks overflows only where the mean does not fit fp16; such values become inf."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire (2 bytes an element, float32's exponent range, 8 mantissa bits)."""

    wire_dtype = torch.bfloat16


class Int8Compressor(Compressor):
    """Symmetric int8 quantization with one float32 scale per ``chunk_size`` elements.

    Element x of a chunk with largest magnitude a becomes q = round(x * 127 / a) in -127..127;
    ``stochastic=True`` rounds up with probability equal to the fraction (unbiased: E[q] is exact),
    drawing from a generator seeded with ``seed`` and, once ``bind`` gives it, the rank (so
    ranks' rounding errors are independent); ``False`` rounds to nearest (error at most
    half a step, a / 254). Wire: one byte an element plus 4 bytes a chunk. Exchanged with all_gather.
    """

    exchange = "all_gather"

    def __init__(self, *, chunk_size: int = 1024, stochastic: bool = True, seed: int = 0) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"Int8Compressor.chunk_size={chunk_size!r}: use a positive int "
                              "(elements sharing one scale; the default is 1024)")
        if not isinstance(stochastic, bool):
            raise ConfigError("Int8Compressor.stochastic must be True (unbiased) or False (nearest)")
        self.chunk_size = chunk_size
        self.stochastic = stochastic
        self.seed = _checked_seed("Int8Compressor", seed)
        self._generator = torch.Generator().manual_seed(self.seed)

    def bind(self, rank: int) -> None:
        """Seeds the rounding noise with ``seed`` and ``rank``: ranks drawing the same noise would
        round the same elements the same way, so their errors would not average out over ranks."""
        self._generator.manual_seed(_mixed_seed(self.seed, rank))

    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        # [Note: int8 of half gradients] Quantised in float32 at least: an fp16 scale (a / 127)
        # of a chunk below about 8e-3 is subnormal or zero (a chunk of 1e-6 would send nothing),
        # and x / scale in fp16 or bf16 is off by more than the half step promised.
        flat = tensor.detach().reshape(-1).to(_at_least_float32(tensor.dtype))
        numel = flat.numel()
        chunks = -(-numel // self.chunk_size)
        padded = torch.zeros(chunks * self.chunk_size, dtype=flat.dtype, device=flat.device)
        padded[:numel] = flat
        rows = padded.view(chunks, self.chunk_size)  # (chunks, chunk_size)
        scales = (rows.abs().amax(dim=1) / _INT8_LEVELS).to(torch.float32)
        # Only an all-zero chunk gets scale 1; a chunk holding inf or nan keeps its non-finite
        # scale, so it decompresses to non-finite values and the overflow stays visible.
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        scaled = rows / scales.to(rows.dtype).unsqueeze(1)
        if self.stochastic:
            # Drawn on the CPU generator: the same seed rounds the same way on every device.
            noise = torch.rand(scaled.shape, generator=self._generator, dtype=scaled.dtype).to(scaled.device)
            levels = torch.floor(scaled + noise)
        else:
            levels = torch.round(scaled)
        levels = levels.nan_to_num_(0.0).clamp_(-_INT8_LEVELS, _INT8_LEVELS)  # nan has no int8
        q = levels.to(torch.int8).reshape(-1)[:numel]
        return (q, scales), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        q, scales = payload
        shape, dtype = ctx
        numel = q.numel()
        wide = _at_least_float32(dtype)  # see [Note: int8 of half gradients]
        padded = torch.zeros(scales.numel() * self.chunk_size, dtype=wide, device=q.device)
        padded[:numel] = q.to(wide)
        rows = padded.view(scales.numel(), self.chunk_size) * scales.to(wide).unsqueeze(1)
        return rows.reshape(-1)[:numel].reshape(shape).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stochastic rounding generator's state, so a resumed run rounds as an uninterrupted
        one would (not as from ``seed`` again)."""
        return {"int8_rng/generator": self._generator.get_state()} if self.stochastic else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "int8_rng/generator" in state:
            self._generator.set_state(state["int8_rng/generator"].to(torch.uint8).clone())

    def __repr__(self) -> str:
        return f"Int8Compressor(chunk_size={self.chunk_size}, stochastic={self.stochastic})"


class TopKCompressor(Compressor):
    """Keeps the ``ratio`` fraction of elements of largest magnitude (at least one): values in
    the gradient's dtype and int32 indices, exchanged with all_gather. Pair it with error
    feedback, which is what makes the dropped elements arrive later instead of never."""

    exchange = "all_gather"

    def __init__(self, ratio: float = 0.01) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ConfigError(f"TopKCompressor.ratio={ratio!r}: use a fraction in (0, 1], "
                              "for example 0.01 to send 1% of the elements")
        self.ratio = float(ratio)

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(round(self.ratio * numel, 6))))  # 0.07 * 100 = 7.000...01

    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        flat = tensor.detach().reshape(-1)
        _, indices = flat.abs().topk(self.k_for(flat.numel()), sorted=False)
        return (flat[indices], indices.to(torch.int32)), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        values, indices = payload
        shape, dtype = ctx
        out = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
        out[indices.to(torch.int64)] = values.to(dtype)
        return out.reshape(shape)

    def __repr__(self) -> str:
        return f"TopKCompressor(ratio={self.ratio})"


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD (Vogels et al., 2019) with warm start.

    A gradient of shape (n, ...) is viewed as an n x m matrix M. It is compressed only when
    ``compressible``: a matrix (2 or more dims, not empty) whose factors hold at most half its elements,
    2 * (n + m) * r <= n * m with r = min(rank, n, m); anything else goes uncompressed. Before
    ``start_iter`` optimizer steps nothing is compressed (plain all_reduce, as DDP).

    One step, with Q the warm-start m x r matrix kept per parameter (the same on every rank):
    P = M Q, summed over ranks; P orthogonalised (Gram-Schmidt); Q_local = M^T P, summed over
    ranks; the mean gradient is P Q_sum^T / world_size and this rank's contribution P Q_local^T.
    Q_sum / world_size is the next step's warm start. The first Q of a parameter is drawn from a
    generator seeded with ``seed`` and the parameter's name, so every rank draws the same one.

    The factors are computed, sent and summed in float32 at least (twice the bytes of P and Q for
    fp16/bf16 gradients): in fp16, P = M Q with a warm-start Q of the gradient's size overflows, and
    bf16's or fp16's rounding is so coarse that orthogonalisation took every column (bf16) or all
    but the first (fp16) for dependent and sent nothing of them. The result has the gradient's dtype.
    """

    exchange = "powersgd"

    def __init__(self, rank: int = 1, start_iter: int = 10, *, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"PowerSGDCompressor.rank={rank!r}: use a positive int (1 to 4 is usual)")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ConfigError(f"PowerSGDCompressor.start_iter={start_iter!r}: use a non-negative int "
                              "(optimizer steps of plain all-reduce before compressing)")
        self.rank = rank
        self.start_iter = start_iter
        self.seed = _checked_seed("PowerSGDCompressor", seed)
        self._warm: dict[str, torch.Tensor] = {}

    # ---- which tensors, when --------------------------------------------------------------
    def is_active(self, iteration: int) -> bool:
        """Whether step ``iteration`` (0-based count of optimizer steps) compresses."""
        return iteration >= self.start_iter

    def matrix_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        n = shape[0] if len(shape) else 1
        return n, math.prod(shape[1:]) if len(shape) > 1 else 1

    def compressible(self, shape: torch.Size | tuple[int, ...]) -> bool:
        if len(shape) < 2 or math.prod(shape) == 0:  # an empty one has nothing to factor
            return False
        n, m = self.matrix_shape(shape)
        r = min(self.rank, n, m)
        return 2 * (n + m) * r <= n * m

    def effective_rank(self, shape: torch.Size | tuple[int, ...]) -> int:
        return min(self.rank, *self.matrix_shape(shape))

    @staticmethod
    def factor_dtype(dtype: torch.dtype) -> torch.dtype:
        """The dtype P and Q of a ``dtype`` gradient are computed and sent in (see the class doc)."""
        return _at_least_float32(dtype)

    # ---- the pieces the exchange composes ---------------------------------------------------
    def warm_start(self, key: str, shape: torch.Size, dtype: torch.dtype,
                   device: torch.device | None = None) -> torch.Tensor:
        """This parameter's m x r matrix Q: last step's mean, or a seeded random first one.

        [Note: dead columns] A column of last step's Q that is all zeros (the gradient was zero,
        or of lower rank than ``rank``) would make P = M Q zero in that column at every later
        step, so that direction would never be sent again; such a column is replaced by the
        seeded random one. Every rank holds the same Q, so every rank replaces the same columns."""
        _, m = self.matrix_shape(shape)
        r = self.effective_rank(shape)
        q = self._warm.get(key)
        if q is None or q.shape != (m, r):
            return self._seeded(key, m, r).to(device=device, dtype=dtype)
        dead = q.abs().amax(dim=0) == 0  # (r,)
        if bool(dead.any()):
            q = torch.where(dead, self._seeded(key, m, r).to(q), q)
        return q.to(device=device, dtype=dtype)

    def _seeded(self, key: str, m: int, r: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_mixed_seed(self.seed, zlib.crc32(key.encode())))
        return torch.randn(m, r, generator=generator, dtype=torch.float64)

    def remember(self, key: str, q: torch.Tensor) -> None:
        self._warm[key] = q.detach().clone()

    def as_matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(self.matrix_shape(tensor.shape))

    @staticmethod
    def project(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return matrix @ q  # (n, m) @ (m, r) -> (n, r)

    @staticmethod
    def orthogonalize(p: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """Gram-Schmidt on the columns of ``p``, in place: orthonormal columns, but one that is
        (numerically) dependent on the earlier ones becomes zero. Deterministic: ranks holding
        the same summed P get bitwise the same result and keep the same columns. Dependence is
        relative: a column is dropped when what is left of it after removing the earlier columns
        is at most ``eps`` times its own norm (an absolute threshold would drop every column of a
        small gradient). ``eps`` defaults to 1000 units in the last place of ``p``'s dtype:
        Gram-Schmidt's rounding leaves about 1e-7 of a dependent float32 column, which a smaller
        ``eps`` would normalise into noise."""
        eps = 1000 * torch.finfo(p.dtype).eps if eps is None else eps
        before = p.norm(dim=0)  # (r,)
        for i in range(p.shape[1]):
            col, done = p[:, i], p[:, :i]  # done: (n, i), orthonormal or zero columns
            # Twice is enough (Kahan, Parlett): one pass leaves a column that kept a fraction f of
            # its norm ulp / f off orthogonal (3e-4 at f = 1e-12 in float64); a second, rounding.
            for _ in range(2):
                col.sub_(done @ (done.t() @ col))
            norm = col.norm()
            if norm > eps * before[i]:
                col.div_(norm)
            else:
                col.zero_()
        return p

    @staticmethod
    def back_project(matrix: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return matrix.t() @ p  # (m, n) @ (n, r) -> (m, r)

    @staticmethod
    def approximate(p: torch.Tensor, q: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return (p @ q.t()).reshape(shape)

    # ---- the plug-in interface (one rank on its own) -----------------------------------------
    def compress(self, tensor: torch.Tensor, *, key: str | None = None) -> tuple[Payload, Any]:
        """One rank's view: (P, Q) with P orthonormal and P Q^T the rank-r approximation;
        tensors that are not ``compressible`` pass as they are."""
        if not self.compressible(tensor.shape):
            return (tensor,), (tensor.shape, None)
        key = "" if key is None else key
        matrix = self.as_matrix(tensor.detach()).to(self.factor_dtype(tensor.dtype))
        p = self.orthogonalize(self.project(matrix, self.warm_start(key, tensor.shape, matrix.dtype, matrix.device)))
        q = self.back_project(matrix, p)
        self.remember(key, q)
        return (p, q), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return payload[0] if dtype is None else self.approximate(payload[0], payload[1], shape).to(dtype)

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"powersgd_q/{key}": q.clone() for key, q in self._warm.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._warm = {k.split("/", 1)[1]: v.clone() for k, v in state.items()
                      if k.startswith("powersgd_q/")}

    def __repr__(self) -> str:
        return f"PowerSGDCompressor(rank={self.rank}, start_iter={self.start_iter})"


COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")


def make_compressor(name: str, **settings: Any) -> Compressor:
    """A compressor by its CLI name: none, fp16, bf16, int8 (chunk_size, stochastic, seed),
    topk (ratio), powersgd (rank, start_iter, seed)."""
    classes = {"none": IdentityCompressor, "identity": IdentityCompressor, "fp16": FP16Compressor,
               "bf16": BF16Compressor, "int8": Int8Compressor, "topk": TopKCompressor,
               "powersgd": PowerSGDCompressor}
    if name not in classes:
        raise ConfigError(f"compressor={name!r}: choose one of {', '.join(COMPRESSORS)}")
    try:
        return classes[name](**settings)
    except TypeError as exc:
        raise ConfigError(f"compressor {name!r} does not take {sorted(settings)}: {exc}") from None


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision dtypes, else ``dtype`` itself (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _checked_seed(owner: str, seed: Any) -> int:
    # int() would take 1.7 as 1 and "7" as 7, and fail on "x" without naming the setting.
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{owner}.seed={seed!r}: use an int (every rank passes the same one)")
    return seed


def _mixed_seed(seed: int, salt: int) -> int:
    """``seed`` and ``salt`` in one seed that torch takes (below 2**63) for any int seed."""
    return (seed * 1_000_003 + salt) % (1 << 63)
