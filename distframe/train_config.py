"""TrainConfig: every setting of ``distframe train``, resolved from defaults, a saved run, a TOML
file and command-line flags (later ones win), and validated in one place.

Field names are the command-line flags with ``-`` written as ``_`` (``--d-model`` is
``d_model``); TOML keys may use either spelling. Every error is a ConfigError that names the flag
and says what to change.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from attention.model import DilatedTransformerConfig
from distframe.backends.base import DEFAULT_TIMEOUT
from distframe.backends.validation import MAX_TIMEOUT
from distframe.errors import ConfigError
from distframe.mesh import inferred_degree
from distframe.train_config_checks import (ModelShape, check_int, check_out, check_unused, csv_of,
                                           fitting_segments, flag, int_tuple)
from distframe.train_parallel import (check_accumulation, check_divides, check_model_parallel,
                                      check_schedule)
from distframe.train_strategies import BASE_OPTIMIZERS, OPTIMIZERS, STRATEGIES

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

BACKENDS = ("auto", "inmemory", "gloo", "mpi", "nccl")
PRESETS = ("tiny", "small")
DTYPES = ("float32", "float64", "bfloat16")
TOKEN_DTYPES = ("uint8", "uint16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
# torch.compile backends for --compile: inductor generates kernels (Triton on GPUs, C++ on CPUs,
# which needs a C compiler); aot_eager and eager trace without generating code (for checking).
COMPILERS = ("inductor", "aot_eager", "eager")
DEFAULT_WORLD_SIZE = 2
# How a run is launched, not what it trains: a resumed run does not take these from its saved
# configuration (it may continue at another world size or on another engine).
LAUNCH_SETTINGS = ("world_size", "backend", "resume", "timeout", "compile")
# Settings of one kind of strategy: left at their defaults under the others.
PARALLEL_SETTINGS = {"dp": ("pipeline", "tensor", "hybrid"), "tp": ("tensor", "hybrid"),
                     "pp": ("pipeline", "hybrid"), "micro_batches": ("pipeline", "hybrid"),
                     "schedule": ("pipeline", "hybrid"), "virtual_stages": ("pipeline", "hybrid"),
                     "cp": ("hybrid",)}
# Settings of one compressor (under --optimizer compressed): left at their defaults with the others.
COMPRESSOR_SETTINGS = {"topk_ratio": ("topk",), "powersgd_rank": ("powersgd",),
                       "powersgd_start": ("powersgd",)}
# DilatedTransformerConfig field for each model flag of the command line.
MODEL_FLAGS = {"layers": "num_layers", "d_model": "embed_dim", "heads": "num_heads",
               "seq_len": "seq_len", "segment_lengths": "segment_lengths",
               "dilation_rates": "dilation_rates"}


def timeout_of(config: TrainConfig) -> dict[str, float]:
    """``--timeout`` as the engines' keyword; nothing when not given (each keeps its default)."""
    return {} if config.timeout is None else {"timeout": float(config.timeout)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The resolved settings of one training run (written to ``OUT/config.json``).

    Model shape: ``preset`` gives every field; ``layers``, ``d_model``, ``heads``, ``seq_len``,
    ``segment_lengths`` and ``dilation_rates`` override it when not None; ``dropout`` is the LM's
    (residual stream, MLP and attention probabilities; each rank draws its own masks, see
    ``train_rng``). ``batch_size`` is the
    global batch in sequences; each data-parallel rank trains on ``batch_size / world size`` of
    them; ``world_size`` None means DEFAULT_WORLD_SIZE when ranks are spawned and the launcher's
    world under mpiexec or torchrun. The learning rate warms up linearly over ``warmup_steps``
    and then follows a cosine down to a tenth of ``lr`` at ``steps`` (``warmup_steps`` above
    ``steps`` is valid, but the peak is never reached: ``train_settings.setting_warnings``
    warns when the user set it). ``data`` None is the default
    corpus (the Python standard library's sources). ``checkpoint_every``/``eval_every`` 0 mean
    only at the end.

    Model-parallel strategies (pipeline, tensor, hybrid): ``dp * tp * pp`` must be the world
    size; degrees left None are inferred (``distframe.models.build_model_parallel``). Each of the
    ``dp`` data-parallel groups trains on ``batch_size / dp`` sequences, in ``micro_batches``
    pieces through the pipeline; ``schedule`` interleaved_1f1b gives each pipeline rank
    ``virtual_stages`` model chunks (Megatron's virtual pipeline stages). ``base_optimizer`` is
    the torch optimizer; ``optimizer`` (none, compressed, async, elastic) the distframe optimizer
    around it, with its own settings (``OPTIMIZERS[name].settings``), which must stay at their
    defaults under the others.
    ``elastic_schedule`` is ``"STEP:WORLD,..."``: after STEP steps the world becomes WORLD
    (each STEP below ``steps``). ``compile`` names a torch.compile backend (COMPILERS) that
    compiles each transformer block in place (``train_loop.build_model_and_optimizer``); None: eager.
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
    dropout: float = 0.0
    activation_checkpointing: bool = False
    steps: int = 200
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    decay_all: bool = False
    max_grad_norm: float = 0.0
    grad_accum_steps: int = 1
    base_optimizer: str = "adamw"
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    optimizer: str = "none"
    compressor: str = "none"
    topk_ratio: float = 0.01
    powersgd_rank: int = 1
    powersgd_start: int = 10
    max_staleness: int = 4
    round_robin: bool = False
    commit_every: int = 1
    elastic_schedule: str | None = None
    fail_at: int | None = None
    seed: int = 0
    dtype: str = "float32"
    data: str | None = None
    token_dtype: str = "uint8"
    out: str = "runs/train"
    resume: bool = False
    checkpoint_every: int = 50
    eval_every: int = 25
    eval_batches: int = 2
    timeout: float | None = None
    compile: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # `compile = true` in a --config file: --compile alone
            object.__setattr__(self, "compile", "inductor" if self.compile else None)
        for name in ("segment_lengths", "dilation_rates"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int_tuple(name, value))
        self._check_choices()
        self._check_numbers()
        self._check_model()
        self._check_optimizer()
        self._check_parallel()
        check_out(self.out)
        if self.data is not None and not isinstance(self.data, str):
            raise ConfigError(f"--data {self.data!r}: use the path of a text file, a directory of "
                              "text files or a .bin token file")
        if self.token_dtype != TrainConfig.token_dtype and not str(self.data).endswith(".bin"):
            # Any other file is read as text, one byte a token: a token file under another name
            # would train on its raw bytes without a word.
            source = self.data or "the default corpus"
            raise ConfigError(f"--token-dtype {self.token_dtype} applies to a flat token file, "
                              f"which --data names by its .bin suffix (--data is {source}); rename "
                              "the token file to end in .bin, or drop --token-dtype for text")
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data}: no such file or directory; pass a text file, "
                              "a directory of text files or a .bin token file (or leave --data out "
                              "for the default corpus)")

    def _check_choices(self) -> None:
        choices = {"strategy": tuple(STRATEGIES), "backend": BACKENDS, "preset": PRESETS,
                   "dtype": DTYPES, "token_dtype": TOKEN_DTYPES,
                   "base_optimizer": tuple(BASE_OPTIMIZERS), "optimizer": tuple(OPTIMIZERS),
                   "schedule": SCHEDULES, "compressor": COMPRESSORS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                hint = (f" (the torch optimizer is --base-optimizer {self.optimizer})"
                        if name == "optimizer" and str(self.optimizer) in BASE_OPTIMIZERS else "")
                raise ConfigError(f"{flag(name)} {getattr(self, name)!r} is unknown; choose one of "
                                  f"{', '.join(allowed)}{hint}")
        if self.compile is not None and self.compile not in COMPILERS:
            raise ConfigError(f"--compile {self.compile!r} is unknown; choose one of {', '.join(COMPILERS)} "
                              "(--compile alone is inductor)")

    def _check_numbers(self) -> None:
        for name in ("steps", "batch_size", "eval_batches"):
            check_int(name, getattr(self, name), minimum=1)
        if self.world_size is not None:
            check_int("world_size", self.world_size, minimum=1)
        for name in ("warmup_steps", "checkpoint_every", "eval_every", "seed", "powersgd_start",
                     "max_staleness"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("micro_batches", "powersgd_rank", "commit_every", "cp", "virtual_stages",
                     "grad_accum_steps"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("layers", "d_model", "heads", "seq_len", "dp", "tp", "pp", "fail_at"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        if self.seed >= 2 ** 63:  # torch.manual_seed takes a signed 64-bit seed
            raise ConfigError(f"--seed {self.seed}: use an integer below 2**63")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            # NaN passes every comparison below, and an infinite rate trains to NaN at once; past
            # float32's range the optimizer's kernels fail to convert it ("without overflow")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 <= value <= FLOAT32_MAX or (name == "lr" and value == 0):
                raise ConfigError(f"{flag(name)} {value!r}: use a positive number"
                                  + (" or 0" if name == "weight_decay" else "")
                                  + f" up to {FLOAT32_MAX:.4g} (float32's largest)")
        norm = self.max_grad_norm
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 <= norm < math.inf:
            raise ConfigError(f"--max-grad-norm {norm!r}: use a positive number such as 1.0 (the "
                              "largest gradient norm a step takes), or 0 for no clipping")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(
                self.timeout, (int, float)) or not 0 < self.timeout <= MAX_TIMEOUT):  # (NaN fails too)
            raise ConfigError(f"--timeout {self.timeout!r}: use a positive number of seconds, at most "
                              f"{MAX_TIMEOUT:g} (about 3 years), that a collective may wait for the other "
                              f"ranks (default {DEFAULT_TIMEOUT:g})")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or \
                not 0 <= self.dropout < 1:  # (NaN fails the comparison too)
            raise ConfigError(f"--dropout {self.dropout!r}: use a probability with 0 <= P < 1, for "
                              "example 0.1 (0 turns dropout off)")
        if not isinstance(self.round_robin, bool):
            raise ConfigError(f"--round-robin {self.round_robin!r}: use true or false")
        for name in ("decay_all", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{flag(name)} {getattr(self, name)!r}: use true or false")
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) or \
                not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"--topk-ratio {self.topk_ratio!r}: use a fraction in (0, 1], for "
                              "example 0.01 to send 1% of the gradient")

    def _check_model(self) -> None:
        shape = self.model_config(vocab_size=256, checked=False)
        if len(shape.segment_lengths) != len(shape.dilation_rates):
            rates = csv_of(shape.dilation_rates) + ("" if self.dilation_rates else
                                                  f" (--preset {self.preset}'s)")
            example = (tuple(shape.dilation_rates) + (1,) * len(shape.segment_lengths))[
                :len(shape.segment_lengths)]
            raise ConfigError(f"--segment-lengths {csv_of(shape.segment_lengths)} and --dilation-rates "
                              f"{rates} differ in length: pass one dilation rate per segment length, "
                              f"for example --dilation-rates {csv_of(example)}")
        too_long = [w for w in shape.segment_lengths if w > shape.seq_len]
        if too_long:
            raise ConfigError(
                f"--segment-lengths {csv_of(shape.segment_lengths)} do not fit --seq-len "
                f"{shape.seq_len}: every segment must be at most the sequence length (for example "
                f"--segment-lengths {csv_of(fitting_segments(shape))})")
        try:
            self.model_config(vocab_size=256)
        except ConfigError as exc:
            raise ConfigError(f"model shape ({self.describe_model()}): {exc}") from None

    def _check_optimizer(self) -> None:
        choice = OPTIMIZERS[self.optimizer]
        if choice.strategies is not None and self.strategy not in choice.strategies:
            raise ConfigError(f"--optimizer {self.optimizer} runs on --strategy "
                              f"{' or '.join(choice.strategies)}, not {self.strategy}; change "
                              "--strategy or use --optimizer none")
        check_unused(self, {name: (opt,) for opt, c in OPTIMIZERS.items() for name in c.settings},
                      "optimizer")
        check_unused(self, COMPRESSOR_SETTINGS, "compressor")  # they were taken, and ignored
        if self.optimizer == "elastic" and self.compile is not None:
            raise ConfigError("--optimizer elastic is an in-memory demo whose workers are threads, "
                              "which do not run compiled models; drop --compile")
        if self.optimizer == "elastic" and self.backend not in ("auto", "inmemory"):
            raise ConfigError(f"--optimizer elastic is an in-memory demo (workers are threads that "
                              f"leave and join); use --backend inmemory, not {self.backend}")
        if self.optimizer == "async" and (self.grad_accum_steps > 1 or self.max_grad_norm):
            raise ConfigError("--optimizer async: each worker pushes the gradient of every batch to "
                              "the server as it comes, so --grad-accum-steps and --max-grad-norm do not "
                              "apply; drop them, or use --optimizer none")
        if self.optimizer == "async" and self.world_size == 1:
            raise ConfigError("--optimizer async needs --world-size >= 2: rank 0 serves the "
                              "parameters and the other ranks train")
        self.elastic_world_sizes()  # parses --elastic-schedule
        # A change at the last step would start a group that trains nothing; a later one is
        # never reached (and its world would still have to divide --batch-size).
        late = [step for step in self.elastic_schedule_steps() if step >= self.steps]
        if late:
            raise ConfigError(f"--elastic-schedule {self.elastic_schedule!r} changes the world after "
                              f"step {late[0]}, but the run ends at --steps {self.steps}; use steps "
                              f"below {self.steps}, or raise --steps")

    def _check_parallel(self) -> None:
        check_unused(self, PARALLEL_SETTINGS, "strategy")
        if self.dropout and self.cp > 1:
            raise ConfigError(f"--dropout {self.dropout} does not run with --cp {self.cp} (ring "
                              "attention has no attention dropout); use --cp 1 or --dropout 0")
        check_schedule(self)
        if self.world_size is None:
            return
        if STRATEGIES[self.strategy].model_parallel:
            check_model_parallel(self, self.world_size)
        elif self.optimizer == "elastic":
            for world in self.elastic_world_sizes():
                check_divides(self.batch_size, world, "--batch-size", "elastic world size "
                              f"{world} (every world of --world-size, --elastic-schedule, "
                              "--fail-at)")
        elif self.optimizer != "async" and self.batch_size % self.world_size:
            # (async: every worker trains on whole batches)
            raise ConfigError(f"--world-size {self.world_size} does not divide --batch-size "
                              f"{self.batch_size} (the global batch); use a world size that divides "
                              f"it, or a batch size that is a multiple of {self.world_size}")
        check_accumulation(self, self.world_size)

    def parallel_degrees(self, world: int) -> tuple[int, int, int]:
        """``(dp, tp, pp)`` with the degrees left None inferred as build_model_parallel does
        (``cp`` is never inferred)."""
        tp, pp = self.tp or 1, self.pp or 1
        if self.strategy == "pipeline":
            dp = self.dp or 1
            pp = self.pp or inferred_degree(world, "pp", dp=dp, tp=tp)
        elif self.strategy == "tensor":
            dp = self.dp or 1
            tp = self.tp or inferred_degree(world, "tp", dp=dp, pp=pp)
        else:
            dp = self.dp or inferred_degree(world, "dp", tp=tp, pp=pp, cp=self.cp)
        return dp, tp, pp

    def elastic_schedule_steps(self) -> dict[int, int]:
        """``--elastic-schedule "STEP:WORLD,..."`` as {step: world size}."""
        if not self.elastic_schedule:
            return {}
        schedule = {}
        for entry in str(self.elastic_schedule).replace(" ", "").split(","):
            step, _, world = entry.partition(":")
            if not (step.isdigit() and world.isdigit() and int(step) > 0 and int(world) > 0):
                raise ConfigError(f"--elastic-schedule {self.elastic_schedule!r}: use STEP:WORLD "
                                  "pairs such as 4:3,8:2 (after step 4 the world becomes 3)")
            if int(step) in schedule:
                raise ConfigError(f"--elastic-schedule {self.elastic_schedule!r} names step {int(step)} "
                                  "twice; give one world size per step")
            schedule[int(step)] = int(world)
        return schedule

    def elastic_world_at(self, step: int) -> int | None:
        """The world an elastic run has at ``step``: the last change of ``--elastic-schedule`` at or
        before it, else ``world_size`` (where a resumed run starts, as the uninterrupted one had)."""
        reached = [world for at, world in sorted(self.elastic_schedule_steps().items()) if at <= step]
        return reached[-1] if reached else self.world_size

    def elastic_world_sizes(self) -> list[int]:
        """Every world size an elastic run passes through: the first, each scheduled one, and
        the one left after the ``fail_at`` failure (one fewer than the world at that step)."""
        schedule = self.elastic_schedule_steps()
        first = self.world_size or DEFAULT_WORLD_SIZE
        sizes = [first, *schedule.values()]
        if self.fail_at is not None:
            at_failure = next((w for s, w in sorted(schedule.items(), reverse=True)
                               if s <= self.fail_at), first)
            if at_failure < 2:
                raise ConfigError(f"--fail-at {self.fail_at}: the world has {at_failure} worker "
                                  "then and none would be left; fail at a step with 2 or more")
            sizes.append(at_failure - 1)
        return sizes

    @property
    def splits_decay(self) -> bool:
        """Whether the optimizer holds the weight decay split (``decay_split``)."""
        return decay_split(self.decay_all, self.weight_decay)

    def model_config(self, *, vocab_size: int, checked: bool = True) -> DilatedTransformerConfig:
        """The DilatedTransformerConfig of the preset with this run's overrides applied."""
        overrides = {MODEL_FLAGS[k]: getattr(self, k) for k in MODEL_FLAGS
                     if getattr(self, k) is not None}
        overrides["vocab_size"], overrides["dropout"] = vocab_size, self.dropout
        overrides["activation_checkpointing"] = self.activation_checkpointing
        if not checked:  # only the fields, for messages that name them before validation
            preset = DilatedTransformerConfig.preset(self.preset)
            return ModelShape(**{f: overrides.get(f, getattr(preset, f))
                             for f in ("seq_len", "segment_lengths", "dilation_rates")})
        return DilatedTransformerConfig.preset(self.preset, **overrides)

    def describe_model(self) -> str:
        parts = [f"--preset {self.preset}"] + [f"{flag(k)} {csv_of(v) if isinstance(v, tuple) else v}"
                                               for k in MODEL_FLAGS if (v := getattr(self, k)) is not None]
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


def decay_split(decay_all: bool, weight_decay: float) -> bool:
    """Whether ``distframe train``'s optimizer holds two param groups, the second (1-D parameters)
    without weight decay: unless ``--decay-all`` or no decay (``train_loop.base_optimizer``)."""
    return not (decay_all or not weight_decay)
