"""``attention`` and ``distframe`` import each other (the LM raises distframe's ConfigError,
context parallelism uses the ring attention): whichever is imported first, in a fresh
interpreter, the LM's errors are distframe's ConfigError, not the ValueError fallback that an
import cycle would leave behind."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = ("import attention.model as a, distframe.errors as e; "
         "assert a.ConfigError is e.ConfigError, a.ConfigError")


@pytest.mark.parametrize("first", ["attention", "attention.model", "distframe", "distframe.models.stages"])
def test_config_error_is_distframes_whatever_is_imported_first(first):
    result = subprocess.run([sys.executable, "-c", f"import {first}; {CHECK}"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
