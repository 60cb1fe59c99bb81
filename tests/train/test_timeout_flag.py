"""``distframe train --timeout SECONDS``: how long a collective may wait for the other ranks
before it raises CollectiveTimeoutError naming the missing ones (the engines' ``timeout=``,
torch's ``init_process_group(timeout=)``). Without it a CLI run could only wait the built-in
300 s, and AsyncSGDOptimizer's hint to raise the timeout named nothing a CLI user could set."""
from __future__ import annotations

import pytest

from distframe import train
from distframe.train_config import TrainConfig
from tests.train.test_bad_input import _fails_with


class _Started(Exception):
    pass


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_one_line(capsys, value):
    _fails_with(capsys, ["train", "--timeout", value, "--steps", "1"], f"--timeout {value}",
                "positive number of seconds")


@pytest.mark.parametrize("value", ["1e10", "1e300"])
def test_a_timeout_past_any_engines_clock_is_one_line(capsys, value):
    # Gloo's store failed at 1e10 s (DistNetworkError) and 1e300 overflowed a timedelta: tracebacks.
    _fails_with(capsys, ["train", "--timeout", value, "--steps", "1"], f"--timeout {float(value)!r}",
                "at most 1e+08")


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf"), 1e10])
def test_an_engine_refuses_a_timeout_out_of_range(timeout):
    from distframe.backends import InMemoryCommunicationBackend
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds up to 1e"):
        InMemoryCommunicationBackend(0, 1, timeout=timeout)


@pytest.mark.parametrize("given,want", [(None, {}), (7.5, {"timeout": 7.5})])
def test_the_timeout_reaches_every_rank_of_a_spawned_run(monkeypatch, tmp_path, given, want):
    seen = {}

    def spawn(fn, world_size, backend, **kw):
        seen.update(kw)
        raise _Started
    monkeypatch.setattr(train, "spawn", spawn)
    config = TrainConfig(out=str(tmp_path), **({} if given is None else {"timeout": given}))
    with pytest.raises(_Started):
        train.run(config)
    assert seen == want  # not given: each engine keeps its own default


def test_the_timeout_reaches_a_launched_rank(monkeypatch, tmp_path):
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(var, value)
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(var, raising=False)
    seen = {}

    def init_backend(name, **kw):
        seen.update(kw)
        raise _Started
    monkeypatch.setattr(train, "init_backend", init_backend)
    with pytest.raises(_Started):
        train.run(TrainConfig(out=str(tmp_path), timeout=42.0, backend="gloo"))
    assert seen == {"timeout": 42.0}
