"""The training loop one rank runs: build the model and its strategy, resume, train, evaluate,
log and checkpoint. Every rank runs the same calls (the collectives inside ``train_step``,
validation and checkpointing need all of them); only rank 0 writes the logs and the plot.

``--optimizer async`` runs ``train_async.AsyncJob`` instead of ``Job`` (the server and the workers
do different things); ``--optimizer elastic`` runs ``Job`` once per group of workers
(``train_elastic``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

from attention.model import DilatedTransformerLM
from distframe import train_checkpoint, train_out, train_rng
from distframe.backends.types import ReduceOp
from distframe.data import (BatchSampler, TokenCorpus, check_windows, load_corpus,
                            validation_offsets)
from distframe.errors import ConfigError, DistFrameError
from distframe.train_config import TrainConfig
from distframe.train_metrics import MetricsLog, ProgressBar, peak_memory_bytes, plot_losses
from distframe.train_strategies import BASE_OPTIMIZERS, STRATEGIES, compressed_settings

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run reached (the same on every rank)."""

    step: int
    train_loss: float | None
    val_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int
    wall_s: float
    out: str
    checkpoint: str | None
    rank: int = 0
    notes: tuple[str, ...] = ()
    # --resume found the run at --steps already: nothing was trained and OUT is unchanged.
    already_finished: bool = False


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: ``(B, T, V)`` logits, ``(B, T)`` targets."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine down to ``lr / 10`` at
    ``steps``; a function of the step alone, so a resumed run follows the same schedule."""
    if step <= config.warmup_steps:
        return config.lr * step / max(1, config.warmup_steps)
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def initial_model_state(config: TrainConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The model's initial parameters, a function of ``config.seed`` alone. Built once per
    process: in-memory ranks share one (torch's global generator is shared by threads)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = DilatedTransformerLM(config.model_config(vocab_size=vocab_size))
    return model.state_dict()


def run_info(config: TrainConfig, corpus: TokenCorpus, world_size: int, backend: str) -> dict:
    """The resolved configuration written to ``OUT/config.json`` and into the metadata of every
    checkpoint ``Job`` saves ("info"), so a checkpoint copied elsewhere keeps its model."""
    model = dataclasses.asdict(config.model_config(vocab_size=corpus.vocab_size))
    return {"train": {**config.to_json(), "world_size": world_size, "backend": backend},
            "model": {k: list(v) if isinstance(v, tuple) else v for k, v in model.items()},
            "data": corpus.description, "data_sha256": corpus.digest}


def load_run_corpus(config: TrainConfig) -> TokenCorpus:
    """The data ``config`` trains on: a directory's walk leaves the run's own --out out (which
    the run writes while it reads), and splits by path only where each side holds a window."""
    seq_len = config.model_config(vocab_size=256, checked=False).seq_len
    return load_corpus(config.data, token_dtype=config.token_dtype, exclude=config.out,
                       window=seq_len + 1)


def train_on_rank(backend: Any, config: TrainConfig, *, backend_name: str,
                  corpus: TokenCorpus | None = None,
                  initial_state: dict[str, torch.Tensor] | None = None,
                  start_notes: Sequence[str] = ()) -> TrainResult:
    """Runs the whole job on this rank of ``backend`` and returns what it reached.
    ``start_notes``: lines rank 0 prints on stderr once the run has started (the settings'
    warnings), before its first step."""
    corpus = corpus or load_run_corpus(config)
    check_windows(corpus, config.model_config(vocab_size=corpus.vocab_size).seq_len)
    initial_state = initial_state or initial_model_state(config, corpus.vocab_size)
    device = _device(backend_name, backend)
    module = DilatedTransformerLM(config.model_config(vocab_size=corpus.vocab_size))
    module.load_state_dict(initial_state)
    module.to(device=device, dtype=DTYPES[config.dtype])
    model, optimizer = build_model_and_optimizer(module, backend, config)
    info = run_info(config, corpus, backend.world_size, backend_name)
    if config.optimizer == "async":  # every worker trains on whole batches
        from distframe.train_async import AsyncJob
        return AsyncJob(backend, config, model, optimizer, corpus, device, info,
                        start_notes=start_notes).run()
    dp_size, dp_rank = STRATEGIES[config.strategy].data_parallel(model, backend)
    if config.batch_size % dp_size:
        raise ConfigError(f"--batch-size {config.batch_size} is not divisible by the {dp_size} "
                          "data-parallel ranks; use a multiple of them")
    return Job(backend, config, model, optimizer, corpus, device, dp_size, dp_rank, info,
               start_notes=start_notes).run()


def build_model_and_optimizer(module: torch.nn.Module, backend: Any, config: TrainConfig,
                              **optimizer_settings: Any) -> tuple[Any, Any]:
    """The strategy's wrapped model and, for ``--optimizer none``, its own optimizer, else
    ``make_optimizer(config.optimizer, ...)`` around ``--base-optimizer``; collective.
    ``optimizer_settings`` go to make_optimizer (the elastic run passes its member)."""
    strategy = STRATEGIES[config.strategy]
    train_rng.use_rank_generators(module, config, backend.world_size, backend.rank)
    if config.compile is not None:  # each block in place (FSDP2's advice): the strategies wrap them
        for block in module.blocks:
            block.compile(backend=config.compile)
    model = strategy.wrap(module, backend, config)
    optimizer, kwargs = base_optimizer(model, config)
    if config.optimizer == "none":
        return model, strategy.optimizer(model, optimizer, kwargs)
    from distframe.optimizers import make_optimizer
    if config.optimizer == "compressed":
        kwargs.update(compressed_settings(config))
    elif config.optimizer == "async":
        kwargs.update(max_staleness=config.max_staleness, deterministic=config.round_robin)
    elif config.optimizer == "elastic":
        kwargs.update(commit_every=config.commit_every)
    return model, make_optimizer(config.optimizer, model, optimizer, **kwargs, **optimizer_settings)


def base_optimizer(model: Any, config: TrainConfig) -> tuple[Any, dict[str, Any]]:
    """``--base-optimizer``'s class and settings, or (the weight decay split, unless
    ``--decay-all`` or no decay) an instance over ``model.parameters()`` whose second group holds
    the 1-D parameters (biases, norm weights) without weight decay, as GPT-2 and nanoGPT train;
    every distframe optimizer keeps an instance's groups."""
    optimizer_cls, settings = BASE_OPTIMIZERS[config.base_optimizer]
    kwargs = settings(config.lr, config.weight_decay)
    if not config.splits_decay:
        return optimizer_cls, kwargs
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return optimizer_cls(groups, **kwargs), {}


def _device(backend_name: str, backend: Any) -> torch.device:
    if backend_name != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", backend.rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def prepare_out(config: TrainConfig, info: dict, log: MetricsLog, notes: Sequence[str] = ()) -> None:
    """Creates OUT, clears an earlier distframe run's metrics and checkpoints there unless
    ``--resume`` (refusing an OUT whose files it cannot tell are distframe's: ``train_out``), and
    writes ``OUT/config.json``; one writer calls it, as the run starts, and it prints ``notes`` on
    stderr (bad input found before this point stays the CLI's one line)."""
    for note in notes:
        print(note, file=sys.stderr)
    out = config.out
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise train_out.cannot_write(out, out, exc) from None
    if not config.resume:
        train_out.check_fresh_out(out)
        if os.path.exists(log.path) or train_checkpoint.latest_checkpoint(out):
            print(f"distframe train: replacing the earlier run in {out} (--resume continues it "
                  "instead)", file=sys.stderr)
        try:
            kept = train_out.remove_earlier_checkpoints(out)
        except OSError as exc:
            raise train_out.cannot_write(out, train_checkpoint.checkpoint_dir(out), exc) from None
        if kept:
            print(f"distframe train: note: left {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''} "
                  f"in {train_checkpoint.checkpoint_dir(out)} (not checkpoints distframe wrote)",
                  file=sys.stderr)
        log.clear()
    else:
        _warn_if_the_data_changed(out, info)
    # Written aside and renamed into place: an interrupted write must not leave a truncated
    # config.json, without which no checkpoint of the run can be resumed or sampled from.
    path = os.path.join(out, "config.json")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
        os.replace(path + ".tmp", path)
    except OSError as exc:  # a full disk, a directory in the way
        raise train_out.cannot_write(out, path, exc) from None


def _warn_if_the_data_changed(out: str, info: dict) -> None:
    """One line on stderr when a resumed run reads other tokens than the run it continues (the
    default corpus is the running Python's standard library; a --data file edited since): it
    goes on, but no longer equals the uninterrupted run."""
    from distframe.train_settings import saved_run
    found = saved_run(out)
    saved = found[0] if found else {}
    before = saved.get("data_sha256")
    if isinstance(before, str) and before != info.get("data_sha256"):
        print(f"distframe train: warning: --resume reads other data than the run in "
              f"{out} trained on ({info.get('data')}, was {saved.get('data')}; "
              "sha256 differs), so it does not continue the same sequence of batches", file=sys.stderr)


class Job:
    """One rank's run; methods are the phases of ``run`` (the elastic run overrides
    ``_start``, ``_stop_before`` and ``_train_step``)."""

    def __init__(self, backend: Any, config: TrainConfig, model: Any, optimizer: Any,
                 corpus: TokenCorpus, device: torch.device, dp_size: int, dp_rank: int,
                 info: dict, *, start_notes: Sequence[str] = ()) -> None:
        self.backend, self.config, self.model, self.optimizer = backend, config, model, optimizer
        self.start_notes = tuple(start_notes)
        self.device, self.dp_size, self.dp_rank, self.info = device, dp_size, dp_rank, info
        self.strategy = STRATEGIES[config.strategy]
        seq_len = info["model"]["seq_len"]
        self.train_data = BatchSampler(corpus.train, batch_size=config.batch_size, seq_len=seq_len,
                                       seed=config.seed)
        self.val_data = BatchSampler(corpus.validation, batch_size=config.batch_size,
                                     seq_len=seq_len, seed=config.seed)
        self.val_offsets = validation_offsets(len(corpus.validation), batches=config.eval_batches,
                                              batch_size=config.batch_size, seq_len=seq_len)
        self.tokens_per_step = config.batch_size * seq_len
        self.is_writer = backend.rank == 0
        self.log = MetricsLog(config.out)
        self.notes: list[str] = []
        self.rng = train_rng.RankRandomState(config, backend, model, device)

    def run(self) -> TrainResult:
        start_step, history = self._start()
        wall_before = history[-1]["wall_s"] if history else 0.0
        last = history[-1] if history else None
        last_val = next((r["val_loss"] for r in reversed(history) if r["val_loss"] is not None), None)
        bar = ProgressBar(total=self.config.steps, initial=start_step, enabled=self.is_writer)
        t0 = time.perf_counter()
        step_tokens, step_seconds, checkpoint = 0, 0.0, None
        try:
            for step in range(start_step + 1, self.config.steps + 1):
                if self._stop_before(step):
                    break
                loss, seconds = self._train_step(step)
                step_tokens, step_seconds = step_tokens + self.tokens_per_step, step_seconds + seconds
                val_loss = self._validate() if self._due(step, self.config.eval_every) else None
                if val_loss is not None and not math.isfinite(val_loss):  # the same on every rank
                    self._diverged(f"the validation loss ({val_loss}) is not finite at step {step}")
                last_val = val_loss if val_loss is not None else last_val
                last = {"step": step, "train_loss": loss, "val_loss": val_loss,
                        "tokens_per_s": self.tokens_per_step / seconds,
                        "peak_memory_bytes": peak_memory_bytes(self.device),
                        "wall_s": wall_before + time.perf_counter() - t0}
                if self.is_writer:
                    self.log.append(last)
                bar.update(last)
                if self._due(step, self.config.checkpoint_every):
                    self._check_finite_parameters(step)  # a checkpoint of NaN would end every resume
                    checkpoint = train_checkpoint.save(self.config.out, step, self.model,
                                                       self.optimizer, self.rng, self.info)
        finally:
            bar.close()
        self._finish()
        return self._result(last, last_val, step_tokens, step_seconds, checkpoint)

    def _stop_before(self, step: int) -> bool:  # noqa: ARG002 - the elastic run's hook
        """True to end this run before ``step`` (the elastic run: its membership changes)."""
        return False

    def _due(self, step: int, every: int) -> bool:
        return step == self.config.steps or (every > 0 and step % every == 0)

    def _start(self) -> tuple[int, list[dict]]:
        """Resumes from the latest checkpoint, or clears an earlier run out of OUT; writes
        ``OUT/config.json``. Returns the step to continue after and the metrics so far."""
        out = self.config.out
        start_step, history = 0, []
        if self.config.resume:
            found = train_checkpoint.agreed_latest_checkpoint(out, self.backend)
            train_checkpoint.check_resume_steps(out, found, self.config.steps)
            start_step, note = train_checkpoint.load(found[0], self.model, self.optimizer, self.rng)
            if note and self.is_writer:
                print(note, file=sys.stderr)
            history = self.log.keep_until(start_step) if self.is_writer else self.log.records()
        self.backend.barrier()  # every rank has read the checkpoint before rank 0 changes OUT
        if self.is_writer:
            prepare_out(self.config, self.info, self.log, self.start_notes)
        self.backend.barrier()
        return start_step, [r for r in history if r["step"] <= start_step]

    def _set_learning_rate(self, step: int) -> None:
        """The schedule's lr for ``step``, and the run's --weight-decay: a checkpoint's optimizer
        state (torch's load_state_dict) and an elastic rollback put back the saved groups'
        settings, and --resume --weight-decay X trained on with the old decay while config.json
        said X."""
        lr = learning_rate(self.config, step)
        groups = self.optimizer.param_groups
        decay = self.config.weight_decay
        decays = [decay, 0.0] if self.config.splits_decay else [decay] * len(groups)  # base_optimizer's
        for group, decay in zip(groups, decays):
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = decay

    def _train_step(self, step: int) -> tuple[float, float]:
        self._set_learning_rate(step)
        inputs, targets = self.train_data.slice(step, self.dp_rank, self.dp_size)
        batch = (inputs.to(self.device), targets.to(self.device))
        started = time.perf_counter()
        try:
            loss = self.model.train_step(batch, next_token_loss, self.optimizer,
                                         max_grad_norm=self.config.max_grad_norm or None,
                                         accumulation_steps=self.config.grad_accum_steps)
        except RuntimeError as exc:  # e.g. Adam's lr / (1 - beta1 ** t) past float32's range
            if "without overflow" not in str(exc):
                raise
            self._diverged(f"step {step}'s update overflowed ({exc})")
        seconds = time.perf_counter() - started
        if not math.isfinite(loss):
            self._diverged(f"the training loss ({loss}) is not finite at step {step}")
        return loss, seconds

    def _check_finite_parameters(self, step: int) -> None:
        """DistFrameError on every rank if any rank's parameters hold inf or NaN (a step's loss
        is computed before its update, so it can be finite while the update is not); collective."""
        finite = [torch.isfinite(t).all() for t in self.model.local_parameter_shard()
                  if t.is_floating_point()]
        bad = bool(finite) and not bool(torch.stack(finite).all())  # one device sync, not one per tensor
        flag = torch.tensor([float(bad)], dtype=torch.float64)
        self.backend.all_reduce(flag, ReduceOp.MAX)
        if flag.item():
            self._diverged(f"the parameters are not finite after step {step}, so it is not saved")

    def _diverged(self, what: str) -> NoReturn:
        half = self.config.dtype in ("float16", "bfloat16")
        raise DistFrameError(f"{what}; lower --lr (now {self.config.lr:g})"
                             f"{' or use --dtype float32' if half else ''} and resume from an "
                             "earlier checkpoint, or start again")

    def _validate(self) -> float:
        """Mean loss over the fixed validation batches (each rank its slice); collective."""
        self.model.eval()
        total = 0.0
        with torch.no_grad():
            for offsets in self.val_offsets:
                inputs, targets = self.val_data.windows(offsets, self.dp_rank, self.dp_size)
                loss = self.strategy.validation_loss(self.model, inputs.to(self.device),
                                                     targets.to(self.device), next_token_loss)
                total += float(loss)
        self.model.train()
        mean = torch.tensor([total / len(self.val_offsets)], dtype=torch.float64)
        self.backend.all_reduce(mean, ReduceOp.AVG)
        return float(mean)

    def _finish(self) -> None:
        if self.is_writer:
            note = plot_losses(self.log.records(), os.path.join(self.config.out, "loss.png"))
            if note:
                self.notes.append(note)

    def _result(self, last: dict | None, last_val: float | None, tokens: int, seconds: float,
                checkpoint: str | None) -> TrainResult:
        latest = train_checkpoint.latest_checkpoint(self.config.out)
        return TrainResult(
            step=last["step"] if last else 0, train_loss=last["train_loss"] if last else None,
            val_loss=last_val, tokens_per_s=tokens / seconds if seconds else 0.0,
            peak_memory_bytes=peak_memory_bytes(self.device),
            wall_s=last["wall_s"] if last else 0.0, out=self.config.out,
            checkpoint=checkpoint or (latest[0] if latest else None), rank=self.backend.rank,
            notes=tuple(self.notes))

