"""Deterministic per-rank inputs and NumPy oracles for the conformance checks.

Every rank can regenerate every peer's input from (seed, rank), so each rank checks its own
result against NumPy without any extra communication. Low-precision and integer dtypes use small
integers, whose sums and products are exact in every dtype and every summation order, so the
oracle is exact for them on every engine; float32/float64 use normal samples and a stated rtol.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")
# Relative tolerances of a reduced result against the float64 oracle. Exact (0) where the inputs
# are small integers; float32/float64 differ from the oracle only by summation order.
RTOL = {"float64": 1e-12, "float32": 1e-6}
# Absolute tolerances for sums that cancel: bounded by world * eps * sum|x| with |x| < 5, world <= 4.
ATOL = {"float64": 1e-12, "float32": 1e-5}


_where = threading.local()  # in-memory ranks are threads: each rank sets its own


@contextlib.contextmanager
def inputs_on(device: str) -> Iterator[None]:
    """Within the block, this rank's ``rank_input`` tensors live on ``device`` (a GPU run of
    the checks: engines must take GPU tensors and give results back on the GPU)."""
    previous = input_device()
    _where.device = torch.device(device)
    try:
        yield
    finally:
        _where.device = previous


def input_device() -> torch.device:
    return getattr(_where, "device", torch.device("cpu"))


def rank_input(rank: int, shape: tuple[int, ...], dtype_name: str, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng([seed, rank, len(shape), *shape])
    if dtype_name == "bool":
        values = rng.integers(0, 2, shape).astype(bool)
    elif dtype_name in RTOL:
        values = rng.standard_normal(shape)
    elif dtype_name == "uint8":
        values = rng.integers(0, 4, shape)  # products of four stay below 256
    elif dtype_name == "int8":
        values = rng.integers(-3, 4, shape)  # products of four stay within int8
    else:
        values = rng.integers(-4, 5, shape)
    return torch.from_numpy(np.asarray(values)).to(DTYPES[dtype_name]).to(input_device())


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bool:
        return t.cpu().numpy()
    return t.to(torch.float64).cpu().numpy()


def reduce_oracle(arrays: list[np.ndarray], op: str, dtype_name: str) -> np.ndarray:
    stack = np.stack([a.astype(bool) if dtype_name == "bool" else a.astype(np.float64) for a in arrays])
    if dtype_name == "bool":
        fn = {"SUM": np.any, "MAX": np.any, "PRODUCT": np.all, "MIN": np.all}[op]
        return fn(stack, axis=0)
    if op == "SUM":
        return stack.sum(axis=0)
    if op == "AVG":
        return stack.mean(axis=0)
    if op == "PRODUCT":
        return stack.prod(axis=0)
    return stack.min(axis=0) if op == "MIN" else stack.max(axis=0)


def assert_matches(actual: torch.Tensor, expected: np.ndarray, dtype_name: str, what: str) -> None:
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {expected.shape}")
    if actual.dtype != DTYPES[dtype_name]:
        raise AssertionError(f"{what}: dtype {actual.dtype}, expected {DTYPES[dtype_name]}")
    if actual.device.type != input_device().type:
        raise AssertionError(f"{what}: result on {actual.device}, the inputs on {input_device()}")
    got = as_numpy(actual)
    if dtype_name == "bool":
        np.testing.assert_array_equal(got, expected, err_msg=what)
        return
    # The oracle is rounded to the tensor's dtype, as an exact reduction would be.
    expected_rounded = as_numpy(torch.from_numpy(np.asarray(expected, dtype=np.float64)).to(actual.dtype))
    np.testing.assert_allclose(got, expected_rounded, rtol=RTOL.get(dtype_name, 0.0),
                               atol=ATOL.get(dtype_name, 0.0), err_msg=what)
