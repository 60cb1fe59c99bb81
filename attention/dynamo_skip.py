"""Puts modules on TorchDynamo's skip list when Dynamo is loaded, without loading it.

``skip(*modules)`` adds each module (a package: all its files) to Dynamo's skip list, as numpy
is: Dynamo runs their frames as ordinary Python, breaking the graph where compiled code calls
them, and compiles what they call from other files as frames of their own. Importing Dynamo
costs 1-2 s, so the list is extended when Dynamo is imported (by the first ``torch.compile``),
through a one-shot import hook, or at once if it is already loaded.
``torch._dynamo.trace_rules.add`` is not a public API: without it (another torch) the hook does
nothing and says so in a warning when it fires. distframe skips its own package this way
([Note: torch.compile] in distframe/compile_support.py), and this package its attention kernels
([Note: dilated attention under torch.compile] in attention/__init__.py).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

_TRACE_RULES = "torch._dynamo.trace_rules"
_pending: list[str] = []


def _add(trace_rules: ModuleType, modules: list[str]) -> None:
    add = getattr(trace_rules, "add", None)
    if add is None:
        warnings.warn(f"this torch's {_TRACE_RULES} has no add(): torch.compile may trace "
                      f"{', '.join(modules)}, which failed or came out wrong with ZeRO-3 and FSDP models "
                      "of several units and with dilated attention; train those uncompiled",
                      RuntimeWarning, stacklevel=2)
        return
    for module in modules:
        add(module)


class _AfterTraceRulesImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``torch._dynamo.trace_rules`` it asks the other finders for the
    spec and has its loader add the pending modules once the module has run."""

    def find_spec(self, fullname: str, path, target=None):  # noqa: ANN001 (importlib's signature)
        if fullname != _TRACE_RULES:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _add(module, _pending)
        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


_finder = _AfterTraceRulesImport()


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def skip(*modules: str) -> None:
    """Puts ``modules`` on Dynamo's skip list now if Dynamo is loaded, else when it is."""
    loaded = sys.modules.get(_TRACE_RULES)
    if loaded is not None:
        _add(loaded, list(modules))
        return
    _pending.extend(m for m in modules if m not in _pending)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
