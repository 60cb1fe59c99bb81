"""A function that rank processes cannot import, given to a process ``spawn`` (one defined under
``if __name__ == "__main__":``, which a rank's process does not run): pickle's "Can't get attribute
'nested' on <module '__mp_main__'>" came back with no hint. Its message now says what to do."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
    import sys
    sys.path.insert(0, {repo!r})
    from distframe.launch import spawn

    if __name__ == "__main__":
        def nested(backend):
            return backend.rank

        try:
            spawn(nested, 2, backend="gloo", timeout=30)
        except AttributeError as exc:
            print("AttributeError:", exc)
"""


def test_a_function_defined_under_main_names_the_fix(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout
    assert "AttributeError: Can't get attribute 'nested'" in out, done.stdout + done.stderr
    assert "top level of a module" in out and "functools.partial" in out, out
