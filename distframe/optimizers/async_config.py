"""AsyncConfig: the settings of AsyncSGDOptimizer (async_sgd.py), validated when built, and
compared across ranks at construction (``check_same_config``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from distframe.backends.protocol import ICommunicationBackend
from distframe.errors import ConfigError
from distframe.optimizers.agreed_settings import check_same_settings, optimizer_settings

FAILURE_POLICIES = ("continue", "stop")
__all__ = ["FAILURE_POLICIES", "AsyncConfig", "check_same_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Settings of AsyncSGDOptimizer.

    max_staleness: the most updates the server may apply between a worker's pull and the
        application of its gradient (workers that would exceed it wait before starting a step).
    server_rank: the rank that serves (it computes no gradients).
    staleness_lr: scale the learning rate of a gradient with staleness t by 1 / (1 + t).
    deterministic: serve workers in a fixed round-robin order (tests; equals a sequential replay).
    on_worker_failure: "continue" without a failed worker, or "stop" every worker cleanly (the
        gradients already pushed are applied; no worker gets parameters again).
    worker_timeout: seconds the server waits for a computing worker before declaring it dead
        (None: the backend's timeout); a worker still alive then gets ``WorkerDroppedError``. Set
        it above the longest step a worker may take.
    """

    max_staleness: int = 4
    server_rank: int = 0
    staleness_lr: bool = False
    deterministic: bool = False
    on_worker_failure: str = "continue"
    worker_timeout: float | None = None

    def __post_init__(self) -> None:
        for field in ("max_staleness", "server_rank"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"AsyncSGDOptimizer {field}={value!r}: use a non-negative int")
        for field in ("staleness_lr", "deterministic"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"AsyncSGDOptimizer {field} must be True or False")
        if self.on_worker_failure not in FAILURE_POLICIES:
            raise ConfigError(f"AsyncSGDOptimizer on_worker_failure={self.on_worker_failure!r}: "
                              f"choose one of {', '.join(FAILURE_POLICIES)}")
        timeout = self.worker_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ConfigError(f"AsyncSGDOptimizer worker_timeout={self.worker_timeout!r}: use a "
                              "positive number of seconds, or None for the backend's timeout")


def check_same_config(backend: ICommunicationBackend, optimizer: Any, config: AsyncConfig) -> None:
    """ConfigError on every rank unless every rank built its optimizer (class, param groups) and
    ``config`` alike; one all_gather. A worker's rate is never applied and its staleness bound
    never enforced, so a worker built unlike its server would run as if they were (a server
    that is to run at another rate has it set by hand after construction, before serve())."""
    check_same_settings(backend, {**optimizer_settings(optimizer), **dataclasses.asdict(config)},
                        "AsyncSGDOptimizer",
                        "build every rank's AsyncSGDOptimizer with the same settings (to give the "
                        "server another rate, set it there after construction, before serve())")
