"""How the MPI engine hands torch tensors to mpi4py: zero-copy views, dtype mapping, host staging.

A contiguous CPU tensor is passed as a NumPy view of its own storage (``tensor.numpy()``), so MPI
reads and writes the tensor's memory directly: no per-call copy for float64, float32 or the
integer dtypes. NumPy has no bfloat16, float8 or complex32, so their bytes travel as int16,
uint8 and int32 (and bool's as uint8) in operations that only move data. MPI cannot reduce
float16, bfloat16 or complex32 (and reducing their bit patterns as integers gives garbage), so
reductions of those dtypes run on a float32 (complex64) copy and round once at the end: the
same numerics as the in-memory engine. bool reductions run on the uint8 view
with MAX (any) and MIN (all), which the base class has already substituted for SUM and PRODUCT.
MIN and MAX are user-defined ops that propagate NaN as NumPy does ([Note: NaN in MPI's MIN and MAX]).

GPU tensors go to mpi4py directly when the MPI library is CUDA-aware; otherwise they are staged
through host memory with :func:`stage_in` / :func:`stage_back`, which take the decision as an
argument so the copy semantics can be tested with CPU tensors.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from distframe.backends.types import ReduceOp
from distframe.errors import BackendUnavailableError

INSTALL_HINT = ("install it with `pip install 'distframe[mpi]'` (or `pip install mpi4py mpich`), "
                "or use another backend")

# Reduction dtypes MPI has no type for: reduced in float32 (complex64) and rounded once.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
# Dtypes NumPy lacks or that MPI should see as another type of the same width (float8 and
# complex32 are only moved: types.UNREDUCIBLE, and complex32 reduces upcast).
_WIRE_VIEW = {torch.bfloat16: torch.int16, torch.bool: torch.uint8, torch.complex32: torch.int32,
              **{dtype: torch.uint8 for dtype in (getattr(torch, n, None) for n in (
                  "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))
                 if dtype is not None}}


# [Note: MPICH algorithm choice] Every engine call is a non-blocking collective (so it can time
# out), and MPICH picks non-blocking algorithms separately from blocking ones. For
# Ireduce_scatter_block its default on one node is up to 10x slower than the blocking call at
# 1 MB (0.9-1.8 ms against 0.09-0.29 ms, world 2 and 4), while the pairwise schedule matches the
# blocking call at 1-64 MB (BENCHMARKS.md). MPICH reads these variables at MPI_Init, so they are
# set before mpi4py initialises MPI, and only where the user has not set them: an exported
# MPIR_CVAR_... wins. Other MPI libraries ignore them.
MPICH_DEFAULTS = {"MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise"}


def import_mpi() -> Any:
    """The ``mpi4py.MPI`` module (importing it initialises MPI), or BackendUnavailableError.

    Before the first import, sets :data:`MPICH_DEFAULTS` in the environment where unset."""
    if "mpi4py.MPI" not in sys.modules:
        for name, value in MPICH_DEFAULTS.items():
            os.environ.setdefault(name, value)
    try:
        MPI = importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise BackendUnavailableError(f"the MPI backend needs mpi4py and an MPI library ({exc}); "
                                      f"{INSTALL_HINT}") from exc
    _check_launcher(MPI)
    return MPI


# What MPICH's and Intel MPI's (Hydra) and Open MPI's launchers export as the number of ranks.
_LAUNCHER_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _check_launcher(MPI: Any) -> None:
    """A launcher that says it started several ranks, and a world of 1: mpi4py loaded another MPI
    library than the launcher's, and every rank initialised as a singleton. Training would go on
    as N unrelated copies, so it is an error here, naming both MPIs."""
    if MPI.COMM_WORLD.Get_size() != 1:
        return
    for name in _LAUNCHER_SIZES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            library = MPI.Get_library_version().strip().splitlines()[0]
            raise BackendUnavailableError(
                f"the launcher set {name}={value} but MPI_COMM_WORLD is a world of 1: mpi4py loaded "
                f"'{library}', not the MPI of the mpiexec that started this process. Start it with "
                "that library's own mpiexec (for the mpich wheel, the one in the virtual environment's "
                "bin/), or point MPI4PY_LIBMPI at the launcher's libmpi")


def mpi_ops(MPI: Any) -> dict[tuple[ReduceOp, bool], Any]:
    """The MPI reduction for each already translated op (SUM, PRODUCT, MIN, MAX) and whether the
    dtype is floating: MPI's own ops, but for floating MIN and MAX ops that propagate NaN ([Note:
    NaN in MPI's MIN and MAX])."""
    minimum, maximum = nan_propagating_ops(MPI)
    exact = {(op, False): mpi_op for op, mpi_op in builtin_ops(MPI).items()}
    return {**exact, **{(op, True): mpi_op for (op, _), mpi_op in exact.items()},
            (ReduceOp.MIN, True): minimum, (ReduceOp.MAX, True): maximum}


def builtin_ops(MPI: Any) -> dict[ReduceOp, Any]:
    """MPI's predefined reductions: exact for integers and bool, order-dependent with NaN."""
    return {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX}


# [Note: NaN in MPI's MIN and MAX] The contract is NumPy's np.minimum / np.maximum (what the
# in-memory engine computes): an element that is NaN on any rank is NaN in the result, on every
# rank. MPICH's MPI_MIN and MPI_MAX compare with `<` and `>`, so with a NaN the answer depends
# on which operand holds it, and since each rank of an all-reduce combines its peers' data in its
# own order, ranks of one call got different answers. These user-defined ops apply np.minimum /
# np.maximum to the buffers MPI hands them, which propagate NaN whatever the order (so every rank
# agrees). float16 and bfloat16 reach them as float32 (``upcast_for_mpi``). Integers and bool
# keep MPI's own ops (``mpi_ops`` is keyed by whether the dtype is floating): the Python callback
# costs a small call a few microseconds (about 4 us for 1024 elements on two ranks of one node;
# at 1 MB NumPy is faster than MPICH's loop). The callback reads host memory:
# a CUDA-aware MPI that hands user-defined ops GPU buffers would need this revisited (untested).
@functools.cache
def nan_propagating_ops(MPI: Any) -> tuple[Any, Any]:
    """(MIN, MAX) as commutative user-defined MPI ops computing np.minimum and np.maximum. Made
    once per process: mpi4py can hold only 32 user-defined ops."""
    return (MPI.Op.Create(_elementwise(np.minimum), commute=True),
            MPI.Op.Create(_elementwise(np.maximum), commute=True))


def _elementwise(ufunc: np.ufunc) -> Callable[[Any, Any, Any], None]:
    """An MPI user function: ``inoutbuf = ufunc(inbuf, inoutbuf)`` on the buffers' elements."""
    def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        dtype = datatype.typechar  # NumPy's character for the MPI datatype ('d', 'f', 'l', ...)
        inout = np.frombuffer(inoutbuf, dtype)
        ufunc(np.frombuffer(inbuf, dtype), inout, out=inout)
    return apply


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` runs in: float32 for float16/bfloat16, else itself."""
    return _UPCAST.get(dtype, dtype)


def wire(tensor: torch.Tensor) -> Any:
    """A buffer mpi4py accepts that aliases ``tensor``'s memory (contiguous tensors only).

    CPU: a NumPy view. Other devices (CUDA-aware MPI only): the tensor itself, whose
    ``__cuda_array_interface__`` / DLPack export mpi4py understands.
    """
    if not tensor.is_contiguous():
        raise ValueError("the MPI engine works on contiguous tensors; call .contiguous() first")
    view_dtype = _WIRE_VIEW.get(tensor.dtype)
    if view_dtype is not None:
        tensor = tensor.view(view_dtype)
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.numpy() if tensor.is_cpu else tensor


_MAX_SPECS = 64  # AddressWire's cache is cleared when it reaches this many buffers


class AddressWire:
    """Buffer specs for mpi4py built from a CPU tensor's address: ``[memory, MPI datatype]``.

    The hot collectives use these instead of :func:`wire`'s NumPy views: a view costs about
    0.7 us to make, an address buffer 0.3 us, which is a tenth of the engine's whole per-call cost
    (BENCHMARKS.md, MPI at 1 MB). The buffer does not keep the tensor alive: callers keep the
    tensor referenced until MPI is done with it (the ``keep`` of a timed-out call). Tensors on other
    devices and dtypes without an entry here go through :func:`wire`.
    """

    def __init__(self, MPI: Any) -> None:
        self._fromaddress = MPI.buffer.fromaddress
        # bool moves as uint8 and float16/bfloat16 as int16; reductions of those never get here
        # (the base class maps bool SUM/PRODUCT to MAX/MIN, _upcast turns halves into float32).
        self._types = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT,
                       torch.int64: MPI.INT64_T, torch.int32: MPI.INT32_T,
                       torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
                       torch.bool: MPI.UINT8_T, torch.float16: MPI.INT16_T,
                       torch.bfloat16: MPI.INT16_T}
        # Specs by (address, bytes, dtype). A spec names memory, it owns none, so one is right
        # for any contiguous tensor with that key, freed and reallocated or not. Reusing it saves
        # building one per call, which after a 1 MB transfer has evicted the interpreter's
        # caches cost about 4 us of a 130 us all_gather (BENCHMARKS.md).
        self._specs: dict[tuple[int, int, torch.dtype], list] = {}

    def __call__(self, tensor: torch.Tensor) -> Any:
        if not tensor.is_cpu:
            return wire(tensor)
        key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype)
        spec = self._specs.get(key)
        if spec is not None and tensor.is_contiguous():
            return spec
        datatype = self._types.get(tensor.dtype)
        if datatype is None:
            return wire(tensor)
        if not tensor.is_contiguous():
            raise ValueError("the MPI engine works on contiguous tensors; call .contiguous() first")
        if len(self._specs) >= _MAX_SPECS:
            self._specs.clear()
        spec = self._specs[key] = [self._fromaddress(tensor.data_ptr(), tensor.nbytes), datatype]
        return spec


def device_aware(MPI: Any) -> bool:
    """Whether the MPI library reads and writes GPU memory itself (mpi4py's query, MPI >= 4.1
    extension); False when the library cannot say."""
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - an MPI without the extension raises MPI.Exception
        return False


def needs_staging(tensor: torch.Tensor, aware: bool) -> bool:
    return not (aware or tensor.is_cpu)


def stage_in(tensor: torch.Tensor, stage: bool) -> torch.Tensor:
    """The tensor MPI should see: a host copy when ``stage``, else ``tensor`` itself."""
    return tensor.to("cpu", copy=True) if stage else tensor


def stage_back(result: torch.Tensor, like: torch.Tensor, stage: bool) -> torch.Tensor:
    """Moves a result computed on a staged host copy to ``like``'s device."""
    return result.to(like.device) if stage else result


def write_back(tensor: torch.Tensor, staged: torch.Tensor) -> None:
    """Copies an in-place result from its staging buffer into ``tensor`` (no-op if not staged)."""
    if staged is not tensor:
        tensor.copy_(staged)


def upcast_for_mpi(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a float16/bfloat16 tensor (MPI cannot reduce those), else the tensor."""
    dtype = reduction_dtype(tensor.dtype)
    return tensor if dtype == tensor.dtype else tensor.to(dtype)


def displacements(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
