"""Conformance checks of the life of groups made with new_group."""
from __future__ import annotations

import pytest
import torch


def check_shutdown_ends_the_groups_made_from_it(backend) -> None:
    """As torch's destroy_process_group: a group's subgroups, nested ones too, end with it. They
    used to go on working here while their peers were told this rank had left them."""
    n = backend.world_size
    group = backend.new_group(list(range(n)))
    sub = group.new_group(list(reversed(range(n))))
    nested = sub.new_group([0])
    group.shutdown()
    for made in (sub, nested):
        if made is None:
            continue
        if not made.is_shut_down:
            raise AssertionError("a subgroup outlived the group it was made from")
        with pytest.raises(ValueError, match="after shutdown"):
            made.all_reduce(torch.zeros(1))
    backend.barrier()  # the group it was made from goes on
