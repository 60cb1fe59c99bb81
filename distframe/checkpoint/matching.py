"""Whether a checkpoint fits the model ``load`` reads it into, checked from the metadata and the
shard files' headers before anything changes (no communication)."""
from __future__ import annotations

from typing import Any

from distframe.checkpoint.format import CheckpointError
from distframe.models.base import ShardedModelBase
from distframe.models.extra_state import is_extra_state
from distframe.models.sharded_state import RangeReader


def check_parameters(meta: dict[str, Any], model: ShardedModelBase, untied: dict[str, str],
                     reader: RangeReader) -> None:
    """CheckpointError naming the first parameter, frozen parameter, buffer or extra state that
    the model and the checkpoint do not share (a parameter frozen on one side only is shared if
    its shape is, and so is an ``untied`` alias, read from the tensor it names)."""
    saved, replicated = meta["parameters"], set(meta["replicated"])
    shapes = {name: info["shape"] for name, info in model.parameter_metadata().items()}
    ours = set(shapes)
    for name, tensor in model.replicated_tensors():
        shapes.setdefault(name, list(tensor.shape))
    for name, shape in shapes.items():
        stored = untied.get(name, name)
        if stored not in saved and stored not in replicated:
            kind = ("parameter" if name in ours else "extra state" if is_extra_state(name)
                    else "buffer or frozen parameter")
            held = sorted(saved) if name in ours else sorted(replicated)
            raise CheckpointError(f"{kind} {name!r} is not in the checkpoint; it holds {held[:5]}"
                                  + ("..." if len(held) > 5 else ""))
        if stored in saved and shape != saved[stored]["shape"]:
            tied = f" (saved tied to {stored!r}, which it reads)" if stored != name else ""
            raise CheckpointError(f"parameter {name!r}{tied} has shape {shape} here but "
                                  f"{saved[stored]['shape']} in the checkpoint")
        frozen = reader.replicated_shape(stored, shape) if name in ours and stored not in saved else None
        if frozen is not None and list(frozen) != shape:  # trained here, saved frozen (whole)
            raise CheckpointError(f"parameter {name!r} has shape {shape} here but {list(frozen)} in the "
                                  "checkpoint (saved frozen, whole)")
    unexpected = sorted((set(saved) | replicated) - set(shapes) - model.replicated_names())
    if unexpected:
        raise CheckpointError(f"the checkpoint holds {unexpected[:5]} that this model does not have "
                              "(it was saved from a different model)")
