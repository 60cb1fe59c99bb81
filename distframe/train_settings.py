"""Where ``distframe train``'s settings come from: defaults, then a resumed run's saved
``OUT/config.json``, then ``--config`` TOML, then the command line's flags; the result is a
validated :class:`~distframe.train_config.TrainConfig`."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from distframe.errors import ConfigError
from distframe.train_checkpoint import latest_checkpoint, read_config_json, saved_run_info
from distframe.train_config import (COMPRESSOR_SETTINGS, LAUNCH_SETTINGS, MODEL_FLAGS, PARALLEL_SETTINGS,
                                    TrainConfig, decay_split, flag)
from distframe.train_strategies import BASE_OPTIMIZERS, OPTIMIZERS


def resolve_config(flags: Mapping[str, Any], toml_path: str | None = None, *,
                   warn: Callable[[str], None] | None = None) -> TrainConfig:
    """Defaults < the saved ``OUT/config.json`` (with ``--resume``) < ``toml_path`` < ``flags``.

    ``flags`` holds only the settings given on the command line (field names as keys). ``warn``
    is called with one line for each setting that is valid but probably not what the user meant
    (see :func:`setting_warnings`).
    """
    settings: dict[str, Any] = {}
    file_settings = load_toml(toml_path) if toml_path else {}
    resume = flags.get("resume", file_settings.get("resume", False))
    out = flags.get("out", file_settings.get("out", TrainConfig.out))
    given = {**file_settings, **flags}
    if isinstance(given.get("data"), str) and given["data"]:
        # Saved absolute in OUT/config.json: --resume from another directory reads the same data.
        given["data"] = os.path.abspath(given["data"])
    if not isinstance(resume, bool):  # bool("false") would resume
        raise ConfigError(f"--resume {resume!r}: use true or false")
    if resume:
        saved, source = _saved_settings(out, given)
        if source != os.path.join(out, "config.json") and warn:
            warn(f"distframe train: note: {out}/config.json is missing, so --resume takes the run's "
                 f"settings from {source}")
        _check_saved_data(saved, given, source)
        settings.update(saved)
    settings.update(given)
    settings["resume"] = resume
    with saved_run_named(resume, out):
        config = TrainConfig(**settings)
    if resume:  # before anything is built: a checkpoint of another shape fails only in the load
        check_resumed_model(config)
    check_given_settings(config, given)
    for line in setting_warnings(config, given) if warn else ():
        warn(line)
    return config


def setting_warnings(config: TrainConfig, given: Collection[str]) -> list[str]:
    """One line for each valid setting that ``given`` (the names set on the command line or in
    ``--config``) makes probably unintended.

    Only given settings count: a default is not the user's choice (the default --warmup-steps 10
    is longer than short runs such as --steps 3), and a resumed run's ``config.json`` holds every
    setting, defaults included, so it cannot tell them apart (its run was warned when it ran).
    """
    lines = []
    if "warmup_steps" in given and config.warmup_steps > config.steps:
        # learning_rate() reaches lr only at step == warmup_steps
        lines.append(f"distframe train: warning: --warmup-steps {config.warmup_steps} exceeds "
                     f"--steps {config.steps}, so the learning rate never reaches its peak --lr "
                     f"{config.lr} (it stops at {config.lr * config.steps / config.warmup_steps:.3g});"
                     f" use --warmup-steps at most {config.steps}, or raise --steps")
    if config.optimizer == "async" and "eval_every" in given and config.eval_every:
        # (warned, not refused: validation at the end only loses no training)
        lines.append(f"distframe train: warning: --eval-every {config.eval_every} does not apply to "
                     "--optimizer async, which validates once, at the end of the run")
    return lines


def check_given_settings(config: TrainConfig, given: Collection[str]) -> None:
    """ConfigError for a setting ``given`` (on the command line or in ``--config``) that the run
    would ignore, losing what the user asked for: ``--optimizer async`` checkpoints only at the
    end (a checkpoint is collective, and the server serves until the last update), so a
    ``--checkpoint-every`` interval would leave a crash nothing to resume from."""
    if config.optimizer == "async" and "checkpoint_every" in given and config.checkpoint_every:
        raise ConfigError(f"--checkpoint-every {config.checkpoint_every}: --optimizer async saves one "
                          "checkpoint, at the end of the run; drop --checkpoint-every (or pass 0), or "
                          "run shorter runs and continue each with --resume")


@contextlib.contextmanager
def saved_run_named(resume: bool, out: str) -> Iterator[None]:
    """Adds to a ConfigError raised inside, when it is about a resumed run, the saved run's values
    of the flags it names and its world size (which --resume does not take): its degrees are not
    on the command line, and a hybrid run saved at --world-size 4 said only that "--dp 2 x --tp 2
    x --pp 1 = 4, but the world has 2 ranks"."""
    try:
        yield
    except ConfigError as exc:
        if not resume or not isinstance(out, str):
            raise
        try:
            found = saved_run(out)
        except ConfigError:
            raise exc from None
        if found is None:
            raise
        saved = found[0].get("train")
        message = str(exc)
        named = [f"{flag(k)} {v}" for k, v in (saved if isinstance(saved, dict) else {}).items()
                 if isinstance(v, int) and not isinstance(v, bool) and k != "world_size"
                 and re.search(re.escape(flag(k)) + r"\b", message)]
        world = saved.get("world_size") if isinstance(saved, dict) else None
        if "world" in message and isinstance(world, int):
            named.insert(0, f"--world-size {world}")
        if not named:
            raise
        raise ConfigError(f"{message} (the run in {out} was saved with {' '.join(named)}; --resume "
                          "takes its settings unless given, but not --world-size)") from None


def restarted_run_checkpoint(config: TrainConfig) -> tuple[str, int] | None:
    """For a run whose launcher restarted its workers (with the same command): the latest
    checkpoint in ``config.out`` if it is this run's, None if OUT holds nothing of a run yet (or
    only this run's metrics). ConfigError if it holds a run of other settings, which this run's
    first attempt died before replacing: a restart continues, and must never delete one."""
    out = config.out
    found = latest_checkpoint(out)
    if found is None and not os.path.exists(os.path.join(out, "metrics.jsonl")):
        return None
    path = os.path.join(out, "config.json")
    saved = read_config_json(path).get("train") if os.path.isfile(path) else None
    if not isinstance(saved, dict):
        difference = f"{path} is missing" if saved is None else f'{path} holds no "train" settings'
    else:  # how it is launched may change (torchrun --nnodes MIN:MAX), and where OUT is
        ours = config.to_json()
        difference = next((f"{flag(k)} {v} there, {ours[k]} here" for k, v in saved.items()
                           if k not in (*LAUNCH_SETTINGS, "out") and ours.get(k, v) != v), None)
    if difference is None:
        return found
    raise ConfigError(f"the launcher restarted the workers, but {out} holds another run ({difference}) "
                      "that this run's first attempt had not replaced yet; relaunch with another --out, "
                      "or remove that run to start this one there")


def check_resumed_model(config: TrainConfig, vocab_size: int | None = None) -> None:
    """ConfigError, naming the flag with its value and the run's, when the model ``config``
    describes is not the one the resumed run in ``config.out`` trained (``OUT/config.json``'s
    "model"): --resume continues that model's checkpoint, which fits no other shape (and other
    segment lengths or dilation rates would load, and silently train another function).
    ``vocab_size``: the vocabulary of the data this run reads; None (not read yet): not compared.
    Dropout and activation checkpointing may change: they are no part of the parameters."""
    found = saved_run(config.out) if latest_checkpoint(config.out) is not None else None
    if found is None:
        return  # nothing to continue: --resume says so itself
    raw, path = found
    saved = raw.get("model")
    if not isinstance(saved, dict):  # not what distframe train writes: the load says what it lacks
        return
    if vocab_size is None:
        vocab_size = saved.get("vocab_size", 256)
    model = dataclasses.asdict(config.model_config(vocab_size=vocab_size))
    # The fields the command line names first: a --seq-len also changes fitted segment lengths.
    for field in ("vocab_size", *MODEL_FLAGS.values(), *model):
        before = tuple(saved[field]) if isinstance(saved.get(field), list) else saved.get(field)
        if field not in ("dropout", "activation_checkpointing") and field in saved and before != model[field]:
            saved_train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
            changed, drop = _model_change(config, field, model[field], before, saved_train)
            raise ConfigError(f"{changed} (in {path}): a resumed run keeps its model; drop {drop} or "
                              "start a new --out")


def _model_change(config: TrainConfig, field: str, value: Any, before: Any,
                  saved_train: Mapping[str, Any]) -> tuple[str, str]:
    """How the flags change model field ``field`` from the run's ``before`` to ``value``, and the
    flags to drop."""
    if field == "vocab_size":
        data = f"--data {config.data or '(the default corpus)'} --token-dtype {config.token_dtype}"
        was = (f"{saved_train.get('data') or 'the default corpus'} with --token-dtype "
               f"{saved_train.get('token_dtype')}")
        return (f"{data}: its vocabulary of {value} tokens differs from the run's {before}, read from {was}",
                "--data and --token-dtype")
    name = next((name for name, model_field in MODEL_FLAGS.items() if model_field == field), None)
    if name is not None and getattr(config, name) is not None:
        return f"{flag(name)} {_setting(value)} differs from the run's {_setting(before)}", flag(name)
    if config.preset != saved_train.get("preset"):
        return f"--preset {config.preset} differs from the run's {saved_train.get('preset')}", "--preset"
    # config.json edited by hand, or the preset itself changed since the run
    return (f"{field} {_setting(value)} of --preset {config.preset} differs from the run's "
            f"{_setting(before)}", "--preset")


def _setting(value: Any) -> str:
    """A setting as the command line spells it: ``8,16,32`` for a list."""
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


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
    except OSError as exc:  # a directory, no permission to read, ...
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror}); pass the path of "
                          "a readable TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets the decoding error through
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"--config {path}: not valid TOML (byte {exc.object[exc.start]:#x} at line "
                          f"{line} is not UTF-8); save the file as UTF-8") from None
    return _known_settings(raw, f"--config {path}")


def saved_run(out: str) -> tuple[dict[str, Any], str] | None:
    """The resolved configuration of the run in ``out`` and where it was read: ``OUT/config.json``
    or, where that is missing (a checkpoint copied into a new OUT), the "info" saved in its latest
    checkpoint, which holds the same; None if OUT has neither."""
    path = os.path.join(out, "config.json")
    if os.path.exists(path):
        return read_config_json(path), path
    found = latest_checkpoint(out)
    return None if found is None else saved_run_info(found[0])


def _check_saved_data(saved: Mapping[str, Any], given: Mapping[str, Any], source: str) -> None:
    """ConfigError when the resumed run's --data, taken from ``source``, is not there (a path
    relative to another directory, saved before paths were saved absolute; data moved since)."""
    data = saved.get("data")
    if "data" in given or not isinstance(data, str) or os.path.exists(data):
        return
    raise ConfigError(f"--resume: the run's --data {data} (from {source}) is not there, seen from "
                      f"{os.getcwd()}; pass --data with the path of that data")


def _saved_settings(out: str, given: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The saved run's settings and where they were read (``saved_run``), less how it was
    launched and, where ``given`` changes the strategy, the schedule, the optimizer, the
    compressor or the data, the old one's own settings (a hybrid run resumed under ddp drops its
    --tp, an interleaved one resumed under 1f1b its --virtual-stages, a token file's run resumed
    on text its --token-dtype)."""
    found = saved_run(out)
    if found is None:
        return {}, os.path.join(out, "config.json")
    raw, path = found
    saved = raw.get("train", raw)
    if not isinstance(saved, dict):
        raise ConfigError(f'{path}: "train" holds {type(saved).__name__}, not the object of '
                          "settings distframe train writes; restore it from the run that wrote OUT")
    saved = dict(saved)
    if str(saved.get("optimizer")) in BASE_OPTIMIZERS:  # runs saved before --base-optimizer existed
        saved["base_optimizer"] = saved.pop("optimizer")
    saved.setdefault("decay_all", True)  # runs saved before the decay split decayed everything
    settings = _known_settings(saved, path)
    trained_with = settings.get("base_optimizer", TrainConfig.base_optimizer)
    if given.get("base_optimizer", trained_with) != trained_with:
        # The checkpoint's optimizer state is that optimizer's: another cannot continue it.
        raise ConfigError(f"--base-optimizer {given['base_optimizer']}: the run in {out} trained "
                          f"with {trained_with}, whose state --resume continues; leave "
                          "--base-optimizer out, or start a new run in another --out")
    _check_decay_groups(out, settings, given)
    dropped = set(LAUNCH_SETTINGS)
    if given.get("strategy", settings.get("strategy")) != settings.get("strategy"):
        dropped.update(PARALLEL_SETTINGS)
    if given.get("schedule", settings.get("schedule")) != settings.get("schedule"):
        dropped.add("virtual_stages")  # model chunks per rank belong to the saved schedule
    if given.get("optimizer", settings.get("optimizer")) != settings.get("optimizer"):
        dropped.update(name for choice in OPTIMIZERS.values() for name in choice.settings)
    if given.get("compressor", settings.get("compressor")) != settings.get("compressor"):
        dropped.update(COMPRESSOR_SETTINGS)  # --topk-ratio, say, belongs to the saved compressor
    if "data" in given and not str(given["data"]).endswith(".bin"):
        dropped.add("token_dtype")  # the saved run's token file's; text is read a byte a token
    return {k: v for k, v in settings.items() if k not in dropped}, path


def _check_decay_groups(out: str, saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """ConfigError when ``given`` changes whether the optimizer holds the weight decay split (two
    param groups, the second without decay) that the saved run trained with: its optimizer
    state belongs to those groups (``train_loop.base_optimizer``)."""
    def split(settings: Mapping[str, Any], fallback: Mapping[str, Any]) -> bool:
        decay_all = settings.get("decay_all", fallback.get("decay_all", TrainConfig.decay_all))
        decay = settings.get("weight_decay", fallback.get("weight_decay", TrainConfig.weight_decay))
        return decay_split(decay_all, decay)

    if split(given, saved) != split(saved, {}):
        was = ("the weight decay split (1-D parameters in a second param group, without decay)"
               if split(saved, {}) else "one param group (--decay-all, or --weight-decay 0)")
        raise ConfigError(
            f"--weight-decay / --decay-all: the run in {out} trained with {was}, whose optimizer "
            "state --resume continues; keep that layout (a nonzero --weight-decay may change), "
            "or start a new run in another --out")


def _known_settings(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    settings = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"{source}: unknown key {key!r}; keys mirror the flags of "
                              "`distframe train --help` (for example d-model = 256)")
        if name in settings:  # d-model and d_model: the later one silently won
            other = next(k for k in raw if k != key and k.replace("-", "_") == name)
            raise ConfigError(f"{source}: keys {other!r} and {key!r} name one setting; keep one")
        settings[name] = value
    return settings
