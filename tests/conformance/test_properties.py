"""Hypothesis over shapes, dtypes, ops and world sizes on the in-memory engine (odd world sizes
and shapes that do not divide evenly included), against the same NumPy oracles."""
import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distframe import spawn
from tests.conformance import checks
from tests.conformance.oracle import DTYPES

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
world_sizes = st.integers(1, 5)
dtype_names = st.sampled_from(list(DTYPES))
ops = st.sampled_from(["SUM", "AVG", "PRODUCT", "MIN", "MAX"])
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(world_size=world_sizes, dtype_name=dtype_names, op=ops, shape=shapes, seed=st.integers(0, 99))
def test_all_reduce_property(world_size, dtype_name, op, shape, seed):
    if dtype_name == "bool" and op == "AVG":
        op = "MAX"
    spawn(functools.partial(checks.check_all_reduce, dtype_name=dtype_name, op=op, shape=shape,
                            seed=seed), world_size, timeout=30)


@SETTINGS
@given(world_size=world_sizes, dtype_name=dtype_names, shape=shapes)
def test_all_gather_property(world_size, dtype_name, shape):
    spawn(functools.partial(checks.check_all_gather, dtype_name=dtype_name, shape=shape, seed=1),
          world_size, timeout=30)


@SETTINGS
@given(world_size=world_sizes, dtype_name=dtype_names.filter(lambda d: d != "bool"),
       rows=st.integers(0, 3), op=st.sampled_from(["SUM", "MIN", "MAX"]))
def test_reduce_scatter_property(world_size, dtype_name, rows, op):
    spawn(functools.partial(checks.check_reduce_scatter, dtype_name=dtype_name, op=op,
                            rows_per_rank=rows), world_size, timeout=30)


@SETTINGS
@given(world_size=world_sizes, dtype_name=dtype_names, root=st.integers(0, 4))
def test_rooted_ops_property(world_size, dtype_name, root):
    spawn(functools.partial(checks.check_gather_scatter, dtype_name=dtype_name, root=root),
          world_size, timeout=30)
    spawn(functools.partial(checks.check_broadcast, dtype_name=dtype_name, src=root), world_size,
          timeout=30)


@SETTINGS
@given(world_size=world_sizes, dtype_name=dtype_names)
def test_all_to_all_property(world_size, dtype_name):
    spawn(functools.partial(checks.check_all_to_all, dtype_name=dtype_name), world_size, timeout=30)
