"""ParallelDims: validation, the Megatron/torchtitan rank layout, and the subgroups it builds."""
from __future__ import annotations

import itertools

import pytest
import torch

from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.mesh import ParallelDims


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "cp"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_degrees_must_be_positive_ints(field, value):
    with pytest.raises(ConfigError, match=f"ParallelDims.{field}"):
        ParallelDims(**{field: value})


def test_world_size_must_match():
    dims = ParallelDims(dp=2, tp=2, pp=1)
    dims.validate(4)
    with pytest.raises(ConfigError, match="product is 8"):
        dims.validate(8)


def test_enabled_properties():
    dims = ParallelDims(dp=1, tp=2, pp=3)
    assert (dims.dp_enabled, dims.tp_enabled, dims.pp_enabled) == (False, True, True)
    assert dims.world_size == 6


@pytest.mark.parametrize("dp,tp,pp,cp", [(2, 2, 2, 1), (3, 1, 2, 1), (1, 4, 1, 1), (2, 3, 1, 1),
                                         (2, 2, 1, 2), (1, 1, 2, 3), (2, 1, 2, 2)])
def test_layout_tp_fastest_then_cp_dp_pp(dp, tp, pp, cp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
    seen = set()
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        rank = dims.rank_of(dp=d, tp=t, pp=p, cp=c)
        assert rank == ((p * dp + d) * cp + c) * tp + t
        assert dims.coordinates(rank) == {"dp": d, "tp": t, "pp": p, "cp": c}
        seen.add(rank)
    assert seen == set(range(dims.world_size))
    for axis in ("dp", "tp", "pp", "cp"):
        groups = dims.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        for g in groups:
            assert [dims.coordinates(r)[axis] for r in g] == list(range(getattr(dims, axis)))
    # Replicas: same tensor and pipeline index, ordered by dp_index * cp + cp_index.
    replicas = dims.group_ranks("replicas")
    assert sorted(r for g in replicas for r in g) == list(range(dims.world_size))
    for g in replicas:
        coords = [dims.coordinates(r) for r in g]
        assert len({(c["tp"], c["pp"]) for c in coords}) == 1
        assert [c["dp"] * cp + c["cp"] for c in coords] == list(range(dp * cp))


def test_out_of_range_coordinates():
    dims = ParallelDims(dp=2, tp=2)
    with pytest.raises(ConfigError):
        dims.coordinates(4)
    with pytest.raises(ConfigError):
        dims.rank_of(tp=2)


def _groups_report(backend, dims):
    groups = dims.build_groups(backend)
    out = {}
    for axis in ("dp", "tp", "pp", "cp", "replicas"):
        group = getattr(groups, axis)
        if group is None:  # cp == 1 builds no cp group
            out[axis] = None
            continue
        # Each member contributes its global rank; the gather shows the group's members in order.
        members = group.all_gather(torch.tensor([backend.rank]))
        out[axis] = (group.rank, members.tolist())
    return out


@pytest.mark.parametrize("dp,tp,pp,cp", [(2, 2, 2, 1), (1, 2, 2, 1), (4, 1, 1, 1), (2, 1, 1, 2),
                                         (1, 2, 2, 2)])
def test_build_groups_members_and_order(dp, tp, pp, cp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
    reports = spawn(lambda b: _groups_report(b, dims), dims.world_size)
    for rank, report in enumerate(reports):
        coords = dims.coordinates(rank)
        coords["replicas"] = coords["dp"] * cp + coords["cp"]
        for axis in ("dp", "tp", "pp", "cp", "replicas"):
            if cp == 1 and axis == "cp":
                assert report[axis] is None
                continue
            index, members = report[axis]
            assert index == coords[axis]
            assert members in dims.group_ranks(axis) and members[index] == rank
