"""The checks and small helpers behind TrainConfig's validation (``train_config.py``): each
raises a ConfigError that names the flag and says what to change."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from distframe.errors import ConfigError


def flag(field: str) -> str:
    """``d_model`` -> ``--d-model``: how users spell a field."""
    return "--" + field.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    seq_len: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]


def int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        if any(isinstance(v, (bool, float)) for v in value):  # TOML 16.5 or true: int() would take them
            raise TypeError
        items = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag(name)} {value!r}: use comma-separated integers such as "
                          "256,512,1024") from None
    if not items or any(v <= 0 for v in items):
        raise ConfigError(f"{flag(name)} {value!r}: use one or more positive integers")
    return items


def check_unused(config: Any, applies: Mapping[str, tuple[str, ...]], owner: str) -> None:
    """ConfigError for a setting changed from its default that ``--<owner>`` does not use."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name, owners in applies.items():
        if getattr(config, name) != defaults[name] and getattr(config, owner) not in owners:
            raise ConfigError(f"{flag(name)} applies to --{owner} {' or '.join(owners)}, not "
                              f"{getattr(config, owner)}; drop {flag(name)} or change --{owner}")


def check_out(out: Any) -> None:
    """``--out`` must be a directory or a path where one can be created (checked before any rank
    starts, which would otherwise fail inside ``os.makedirs`` with a traceback)."""
    if not isinstance(out, str) or not out:
        raise ConfigError(f"--out {out!r}: use the path of a directory (created if missing)")
    check_utf8_path("--out", out)
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--out {out}: {existing} is not a directory; pass a directory path "
                          "(created if missing)")


def check_utf8_path(name: str, path: str) -> None:
    """ConfigError unless ``path`` is valid UTF-8: safetensors cannot open a checkpoint file at any
    other path, so a run there trained, then wrote checkpoints that nothing could load."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:  # a name that is not UTF-8 (PEP 383's surrogate escapes)
        raise ConfigError(f"{name} {path}: use a path that is valid UTF-8 (safetensors cannot "
                          "open others)") from None


def check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag(name)} {value!r}: use an integer >= {minimum}")


def fitting_segments(shape: ModelShape) -> tuple[int, ...]:
    """Segment lengths scaled so the longest equals the sequence length."""
    longest = max(shape.segment_lengths)
    return tuple(max(r, shape.seq_len * w // longest // r * r)
                 for w, r in zip(shape.segment_lengths, shape.dilation_rates))


def csv_of(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)
