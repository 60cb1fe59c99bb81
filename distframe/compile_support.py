"""Keeps torch.compile (TorchDynamo) out of distframe's own code.

[Note: torch.compile] Users compile the model they wrap (``DDPModel(torch.compile(net))``), its
blocks in place (``block.compile()``, as FSDP2 recommends), or the wrapped model
(``torch.compile(ZeRO3Model(net))``). In each case Dynamo meets distframe's code: the hooks that
gather and free a unit's parameters, the wrappers' forward, and the collectives they call. Traced
by Dynamo, that code ran as compiled fragments: a unit's gather was cut off from the parameter
swap that follows it, so a ZeRO-3 or FSDP forward read its NaN stand-ins (the wrapper then blamed
the user's model), and a collective traced inside the wrapper's forward failed inside the engine.
So every frame in the ``distframe`` package is on Dynamo's skip list, as numpy's is: Dynamo runs
it as ordinary Python, breaking the graph where compiled code calls into it, and goes on compiling
the user's modules that distframe calls (the wrapped model's forward, called from ours, is a frame
of its own). The ``attention`` package skips its attention kernels itself ([Note: dilated
attention under torch.compile] in attention/__init__.py); its LM, blocks and projections are the
user's model and compile.

[Note: compiled code on in-memory ranks] In-memory ranks are threads of one process, so they run
the same compiled graphs, from one Dynamo cache, at once, which torch does not promise to support.
Compiled ZeRO-3 training (units per module, the blocks or the whole model compiled) there once
ended 7e-8 to 1.4e-7 off one process in float64 in 4 runs of 6; the same training as Gloo
processes was exact in every run, with AOTAutograd and with inductor. A later session could not
make it happen again: about 80 runs of DDP, ZeRO-1/2/3 and FSDP, compiled each of the three ways,
at 2 and 3 ranks, with uneven per-rank batches, AOTAutograd and inductor, under load, were exact.
With no cause found, a sharded model on in-memory ranks refuses to run compiled
(``refuse_on_threads``) rather than risk a wrong answer, unless its process has one rank (one
thread runs compiled code: ``distframe train --compile --world-size 1``).

The list is extended through ``attention.dynamo_skip``, which does it when Dynamo is imported.
"""
from __future__ import annotations

import sys

from torch import nn

from attention import dynamo_skip
from distframe.errors import ConfigError


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (without importing Dynamo)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    # None while another thread imports Dynamo (building a process's first torch.optim optimizer
    # does): the half-built module has no OptimizedModule yet, and nothing can be one.
    compiled = getattr(eval_frame, "OptimizedModule", None)
    return compiled is not None and isinstance(module, compiled)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a torch.compile'd ``module`` compiles (else ``module``): what a wrapper names
    things by. A compiled module's names carry "_orig_mod.", so a checkpoint or
    ``gather_full_parameters()`` of a wrapped ``torch.compile(net)`` did not load into ``net``
    (torch's ``get_model_state_dict`` strips the prefix, too); the wrapper still calls the
    compiled module."""
    return module._orig_mod if is_compiled_module(module) else module


def _compiling_around(model: nn.Module) -> bool:
    """Whether Dynamo is compiling a caller of ``model``'s forward (an outer ``torch.compile``), or
    ``model`` or a submodule is compiled (``torch.compile(net)``, ``block.compile()``)."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    if get_eval_frame_callback() not in (None, False):
        return True
    return any(is_compiled_module(m) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def refuse_on_threads(model: nn.Module, backend: object) -> None:
    """ConfigError if ``model`` runs compiled on in-memory ranks: see [Note: compiled code on
    in-memory ranks]. Free unless Dynamo has been imported."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return
    from distframe.backends.inmemory import InMemoryCommunicationBackend
    if (isinstance(backend, InMemoryCommunicationBackend) and len(backend.world.enlisted) > 1
            and _compiling_around(model)):
        raise ConfigError(
            "torch.compile is not supported on in-memory ranks: they are threads of one process "
            "sharing one Dynamo cache, and compiled ZeRO-3 training there once came out up to 1.4e-7 "
            "off one process in float64, differently from run to run. Run the ranks as processes "
            "(spawn(fn, n, 'gloo'), mpiexec or torchrun), use one rank, or do not compile")


def install() -> None:
    """Puts distframe on Dynamo's skip list now if Dynamo is loaded, else when it is."""
    dynamo_skip.skip("distframe")
