"""Every collective on every engine against a NumPy oracle (checks in checks.py)."""
import itertools

import pytest

from tests.conformance import checks, checks_dtypes, checks_functional, checks_groups
from tests.conformance.oracle import DTYPES, FLOAT_NAMES

OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
REDUCE_CASES = [(d, op) for d, op in itertools.product(DTYPES, OPS)
                if not (d == "bool" and op == "AVG")]


@pytest.mark.parametrize("dtype_name,op", REDUCE_CASES)
def test_all_reduce(runner, dtype_name, op):
    runner.run(checks.check_all_reduce, dtype_name=dtype_name, op=op, shape=(3, 5))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1031,), (2, 3, 4)])
def test_all_reduce_shapes(runner, shape):
    runner.run(checks.check_all_reduce, dtype_name="float64", op="SUM", shape=shape)


def test_all_reduce_non_contiguous(runner):
    runner.run(checks.check_all_reduce_non_contiguous)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_gather(runner, dtype_name):
    runner.run(checks.check_all_gather, dtype_name=dtype_name, shape=(2, 3))


@pytest.mark.parametrize("shape", [(), (0, 4), (5,)])
def test_all_gather_shapes(runner, shape):
    runner.run(checks.check_all_gather, dtype_name="float32", shape=shape)


@pytest.mark.parametrize("dtype_name,op", [(d, "SUM") for d in DTYPES if d != "bool"]
                         + [("float32", "MAX"), ("float64", "AVG"), ("bfloat16", "AVG"), ("bool", "SUM")])
def test_reduce_scatter(runner, dtype_name, op):
    runner.run(checks.check_reduce_scatter, dtype_name=dtype_name, op=op, rows_per_rank=2)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "bool"])
@pytest.mark.parametrize("src", [0, -1])
def test_broadcast(runner, dtype_name, src):
    runner.run(checks.check_broadcast, dtype_name=dtype_name, src=src)


@pytest.mark.parametrize("dtype_name,op", [("float64", "SUM"), ("float16", "SUM"), ("int32", "MAX"),
                                            ("float32", "AVG"), ("bool", "PRODUCT")])
@pytest.mark.parametrize("dst", [0, -1])
def test_reduce(runner, dtype_name, op, dst):
    runner.run(checks.check_reduce, dtype_name=dtype_name, op=op, dst=dst)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "uint8"])
@pytest.mark.parametrize("root", [0, -1])
def test_gather_and_scatter(runner, dtype_name, root):
    runner.run(checks.check_gather_scatter, dtype_name=dtype_name, root=root)


@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16", "int8"])
def test_all_to_all(runner, dtype_name):
    runner.run(checks.check_all_to_all, dtype_name=dtype_name)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_point_to_point(runner, dtype_name):
    runner.run(checks.check_point_to_point, dtype_name=dtype_name)


def test_async_ops(runner):
    runner.run(checks.check_async_ops)


def test_subgroups(runner):
    runner.run(checks.check_subgroups)


def test_shutdown_ends_the_groups_made_from_it(runner):
    runner.run(checks_groups.check_shutdown_ends_the_groups_made_from_it)


def test_stats(runner):
    runner.run(checks.check_stats)


def test_bad_arguments(runner):
    runner.run(checks.check_bad_arguments)


def test_edge_shapes(runner):
    runner.run(checks.check_float_edge_shapes)


def test_float_dtypes_listed():
    assert set(FLOAT_NAMES) <= set(DTYPES)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int32", "bool"])
def test_out_buffers(runner, dtype_name):
    runner.run(checks.check_out_buffers, dtype_name=dtype_name)


def test_async_results_not_retained(runner):
    runner.run(checks.check_async_results_not_retained)


def test_byte_objects(runner):
    runner.run(checks.check_byte_objects)


def test_post_first(runner):
    runner.run(checks.check_post_first)


def test_tensors_that_require_grad(runner):
    runner.run(checks.check_tensors_that_require_grad)


def test_low_precision_average(runner):
    runner.run(checks_dtypes.check_low_precision_average)


def test_scatter_of_rarer_dtypes(runner):
    runner.run(checks_dtypes.check_scatter_of_rarer_dtypes)


def test_rarer_dtypes_move_alike(runner):
    runner.run(checks_dtypes.check_rarer_dtypes_move_alike)


def test_complex_min_max_is_refused_alike(runner):
    runner.run(checks_dtypes.check_complex_min_max_is_refused_alike)


def test_complex32_average(runner):
    runner.run(checks_dtypes.check_complex32_average)


def test_lazy_views_move_their_values(runner):
    runner.run(checks_dtypes.check_lazy_views_move_their_values)


def test_zero_dim_all_to_all_chunks_are_named(runner):
    runner.run(checks_dtypes.check_zero_dim_all_to_all_chunks_are_named)


def test_functional_all_to_all_outputs_take_in_place_ops(runner):
    runner.run(checks_functional.check_functional_all_to_all_outputs_take_in_place_ops)


def test_functional_gathered_last_dim_takes_in_place_ops(runner):
    runner.run(checks_functional.check_functional_gathered_last_dim_takes_in_place_ops)
