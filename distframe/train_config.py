"""TrainConfig: every setting of ``distframe train``, resolved from defaults, a saved run, a TOML
file and command-line flags (later ones win), and validated in one place.

Field names are the command-line flags with ``-`` written as ``_`` (``--d-model`` is
``d_model``); TOML keys may use either spelling. Every error is a ConfigError that names the flag
and says what to change.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from attention.model import DilatedTransformerConfig
from distframe.errors import ConfigError
from distframe.train_strategies import OPTIMIZERS, STRATEGIES

BACKENDS = ("auto", "inmemory", "gloo", "mpi", "nccl")
PRESETS = ("tiny", "small")
DTYPES = ("float32", "float64", "bfloat16")
TOKEN_DTYPES = ("uint8", "uint16")
DEFAULT_WORLD_SIZE = 2
# How a run is launched, not what it trains: a resumed run does not take these from its saved
# configuration (it may continue at another world size or on another engine).
LAUNCH_SETTINGS = ("world_size", "backend", "resume")
# DilatedTransformerConfig field for each model flag of the command line.
MODEL_FLAGS = {"layers": "num_layers", "d_model": "embed_dim", "heads": "num_heads",
               "seq_len": "seq_len", "segment_lengths": "segment_lengths",
               "dilation_rates": "dilation_rates"}


def flag(field: str) -> str:
    """``d_model`` -> ``--d-model``: how users spell a field."""
    return "--" + field.replace("_", "-")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The resolved settings of one training run (written to ``OUT/config.json``).

    Model shape: ``preset`` gives every field; ``layers``, ``d_model``, ``heads``, ``seq_len``,
    ``segment_lengths`` and ``dilation_rates`` override it when not None. ``batch_size`` is the
    global batch in sequences; each data-parallel rank trains on ``batch_size / world size`` of
    them; ``world_size`` None means DEFAULT_WORLD_SIZE when ranks are spawned and the launcher's
    world under mpiexec or torchrun. The learning rate warms up linearly over ``warmup_steps`` and then follows a cosine
    down to a tenth of ``lr`` at ``steps``. ``data`` None is the default corpus (the Python
    standard library's sources). ``checkpoint_every``/``eval_every`` 0 mean only at the end.
    """

    strategy: str = "ddp"
    backend: str = "auto"
    world_size: int | None = None
    preset: str = "small"
    layers: int | None = None
    d_model: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    segment_lengths: tuple[int, ...] | None = None
    dilation_rates: tuple[int, ...] | None = None
    steps: int = 200
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    optimizer: str = "adamw"
    seed: int = 0
    dtype: str = "float32"
    data: str | None = None
    token_dtype: str = "uint8"
    out: str = "runs/train"
    resume: bool = False
    checkpoint_every: int = 50
    eval_every: int = 25
    eval_batches: int = 2

    def __post_init__(self) -> None:
        for name in ("segment_lengths", "dilation_rates"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int_tuple(name, value))
        self._check_choices()
        self._check_numbers()
        self._check_model()
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data}: no such file or directory; pass a text file, "
                              "a directory of text files or a .bin token file (or leave --data out "
                              "for the default corpus)")

    def _check_choices(self) -> None:
        choices = {"strategy": tuple(STRATEGIES), "backend": BACKENDS, "preset": PRESETS,
                   "dtype": DTYPES, "token_dtype": TOKEN_DTYPES, "optimizer": tuple(OPTIMIZERS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{flag(name)} {getattr(self, name)!r} is unknown; choose one of "
                                  f"{', '.join(allowed)}")

    def _check_numbers(self) -> None:
        for name in ("steps", "batch_size", "eval_batches"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.world_size is not None:
            _check_int("world_size", self.world_size, minimum=1)
        for name in ("warmup_steps", "checkpoint_every", "eval_every", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("layers", "d_model", "heads", "seq_len"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    name == "lr" and value == 0):
                raise ConfigError(f"{flag(name)} {value!r}: use a positive number"
                                  + (" or 0" if name == "weight_decay" else ""))
        if self.world_size is not None and self.batch_size % self.world_size != 0:
            raise ConfigError(f"--world-size {self.world_size} does not divide --batch-size "
                              f"{self.batch_size} (the global batch); use a world size that divides "
                              f"it, or a batch size that is a multiple of {self.world_size}")

    def _check_model(self) -> None:
        shape = self.model_config(vocab_size=256, checked=False)
        too_long = [w for w in shape.segment_lengths if w > shape.seq_len]
        if too_long:
            raise ConfigError(
                f"--segment-lengths {_csv(shape.segment_lengths)} do not fit --seq-len "
                f"{shape.seq_len}: every segment must be at most the sequence length (for example "
                f"--segment-lengths {_csv(_fitting_segments(shape))})")
        try:
            self.model_config(vocab_size=256)
        except ConfigError as exc:
            raise ConfigError(f"model shape ({self.describe_model()}): {exc}") from None

    def model_config(self, *, vocab_size: int, checked: bool = True) -> DilatedTransformerConfig:
        """The DilatedTransformerConfig of the preset with this run's overrides applied."""
        overrides = {MODEL_FLAGS[k]: getattr(self, k) for k in MODEL_FLAGS
                     if getattr(self, k) is not None}
        overrides["vocab_size"] = vocab_size
        if not checked:  # only the fields, for messages that name them before validation
            preset = DilatedTransformerConfig.preset(self.preset)
            return _Shape(**{f: overrides.get(f, getattr(preset, f))
                             for f in ("seq_len", "segment_lengths", "dilation_rates")})
        return DilatedTransformerConfig.preset(self.preset, **overrides)

    def describe_model(self) -> str:
        parts = [f"--preset {self.preset}"] + [f"{flag(k)} {_csv(v) if isinstance(v, tuple) else v}"
                                               for k in MODEL_FLAGS if (v := getattr(self, k)) is not None]
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class _Shape:
    seq_len: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]


def resolve_config(flags: Mapping[str, Any], toml_path: str | None = None) -> TrainConfig:
    """Defaults < the saved ``OUT/config.json`` (with ``--resume``) < ``toml_path`` < ``flags``.

    ``flags`` holds only the settings given on the command line (field names as keys).
    """
    settings: dict[str, Any] = {}
    file_settings = load_toml(toml_path) if toml_path else {}
    resume = flags.get("resume", file_settings.get("resume", False))
    out = flags.get("out", file_settings.get("out", TrainConfig.out))
    if resume:
        settings.update(_saved_settings(out))
    settings.update(file_settings)
    settings.update(flags)
    settings["resume"] = bool(resume)
    return TrainConfig(**settings)


def load_toml(path: str) -> dict[str, Any]:
    """The settings of a TOML file whose keys mirror the flags (``d-model`` or ``d_model``)."""
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ConfigError(f"--config {path}: reading TOML on Python < 3.11 needs tomli; "
                              "install it with `pip install tomli`") from None
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; pass the path of a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    return _known_settings(raw, f"--config {path}")


def _saved_settings(out: str) -> dict[str, Any]:
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    settings = _known_settings(saved.get("train", saved), path)
    return {k: v for k, v in settings.items() if k not in LAUNCH_SETTINGS}


def _known_settings(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    settings = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"{source}: unknown key {key!r}; keys mirror the flags of "
                              "`distframe train --help` (for example d-model = 256)")
        settings[name] = value
    return settings


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        items = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag(name)} {value!r}: use comma-separated integers such as "
                          "256,512,1024") from None
    if not items or any(v <= 0 for v in items):
        raise ConfigError(f"{flag(name)} {value!r}: use one or more positive integers")
    return items


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag(name)} {value!r}: use an integer >= {minimum}")


def _fitting_segments(shape: _Shape) -> tuple[int, ...]:
    """Segment lengths scaled so the longest equals the sequence length."""
    longest = max(shape.segment_lengths)
    return tuple(max(r, shape.seq_len * w // longest // r * r)
                 for w, r in zip(shape.segment_lengths, shape.dilation_rates))


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)
