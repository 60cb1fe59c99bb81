"""torch.compile with the strategies ([Note: torch.compile] in distframe/compile_support.py).

Three ways users compile: the module before wrapping ("inner": ``Model(torch.compile(net))``),
its blocks in place ("blocks": ``block.compile()``, FSDP2's advice), and the wrapped model
("outer": ``torch.compile(Model(net))``). Before distframe's frames were on Dynamo's skip list,
ZeRO-3 failed all three and FSDP "outer" failed: Dynamo compiled the units' gather hooks and the
wrapper's collectives in pieces, and the forward read the NaN stand-ins. Each case trains three
Adam steps in float64 on 2 Gloo processes and on 2 MPI ranks (one pool of each for the module)
and must equal one process to 1e-10 (the parity contract), with the user's code compiled (Dynamo
made graphs on the rank); so must a pipeline of compiled blocks. In-memory ranks refuse compiled
models unless there is one of them ([Note: compiled code on in-memory ranks]). ``aot_eager``
compiles forward and backward through AOTAutograd without needing a C compiler;
tests/models/test_gpu_compile.py runs inductor on GPUs.
"""
from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from distframe._mpi_launch import MPIPool
from distframe._process_launch import ProcessPool
from distframe.errors import ConfigError
from distframe.launch import spawn
from distframe.models import PipelineParallelModel, TensorParallelModel
from tests.models.common import (IN, OUT, SEED_LOCK, SETTINGS, STRATEGIES, Block, build_model,
                                 global_batches, loss_fn, rank_slice, reference_run)

COMPILER = "aot_eager"
STEPS, BATCH, WORLD = 3, 8, 2


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def _compiled_as(net: nn.Module, where: str, compiler: str = COMPILER) -> nn.Module:
    if where == "blocks":
        for block in net:
            if isinstance(block, Block):
                block.compile(backend=compiler)
    return torch.compile(net, backend=compiler) if where == "inner" else net


@pytest.fixture(scope="module", params=[pytest.param("gloo", marks=pytest.mark.gloo),
                                        pytest.param("mpi", marks=pytest.mark.mpi)])
def pool(request):
    """The process engines' ranks, started once for the module (Dynamo under mpiexec too)."""
    pool = ProcessPool(WORLD, "gloo", timeout=60) if request.param == "gloo" else MPIPool(WORLD, timeout=60)
    yield pool
    pool.close()


def _train_compiled(backend, strategy: str, where: str, device: str = "cpu", compiler: str = COMPILER):
    """Rank function: (parameters after the steps, on the CPU; graphs Dynamo made on this rank).
    The model and batches are on ``device`` (tests/models/test_gpu_compile.py runs it on GPUs)."""
    torch._dynamo.reset()  # the pool's processes live on: compile afresh for each case
    graphs = _graphs()
    model_cls, optimizer_cls = STRATEGIES[strategy]
    net = _compiled_as(build_model().to(device), where, compiler)
    model = model_cls(net, backend, **SETTINGS[strategy])
    optimizer = optimizer_cls(model, torch.optim.Adam, lr=1e-2)
    forward = torch.compile(model, backend=compiler) if where == "outer" else model
    for batch in global_batches(STEPS, BATCH):
        x, y = (t.to(device) for t in rank_slice(batch, backend.rank, backend.world_size))
        loss_fn(forward(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = {name: value.cpu() for name, value in model.gather_full_parameters().items()}
    return params, _graphs() - graphs


@pytest.mark.parametrize("strategy,where", [
    ("ddp", "outer"), ("zero2", "inner"), ("zero3", "inner"), ("zero3", "blocks"), ("zero3", "outer"),
    ("fsdp", "blocks"), ("fsdp", "outer")])
def test_compiled_training_equals_one_process(pool, strategy, where):
    expected = reference_run(global_batches(STEPS, BATCH))[-1]
    for params, graphs in pool.run(functools.partial(_train_compiled, strategy=strategy, where=where)):
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
        assert graphs > 0, "nothing was compiled"


@pytest.mark.parametrize("strategy,where", [("ddp", "inner"), ("zero3", "blocks"), ("fsdp", "outer"),
                                             ("tp", "outer"), ("pp", "blocks")])
def test_in_memory_ranks_refuse_a_compiled_model(strategy, where):
    x, y = global_batches(1, 4)[0]

    def run(backend):
        if strategy == "tp":
            model = TensorParallelModel(_mlp(), backend, plan={"fc1": "column", "fc2": "row"})
        elif strategy == "pp":  # its train_step runs the stages without the model's forward
            model = PipelineParallelModel(_compiled_as(build_model(), where), backend, num_microbatches=2)
            model.train_step((x, y), loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
            return
        else:
            model = STRATEGIES[strategy][0](_compiled_as(build_model(), where), backend, **SETTINGS[strategy])
        forward = torch.compile(model, backend=COMPILER) if where == "outer" else model
        forward(x)

    with pytest.raises(ConfigError, match=r"torch\.compile is not supported on in-memory ranks.*'gloo'"):
        spawn(run, WORLD)


@pytest.mark.parametrize("strategy,where", [("zero3", "outer"), ("fsdp", "blocks")])
def test_one_in_memory_rank_trains_compiled(strategy, where):
    """One thread runs the compiled code: nothing to race, so it is allowed (and exact)."""
    expected = reference_run(global_batches(STEPS, BATCH))[-1]
    params, graphs = spawn(functools.partial(_train_compiled, strategy=strategy, where=where), 1)[0]
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
    assert graphs > 0, "nothing was compiled"


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, 16), nn.Linear(16, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _mlp(device: str = "cpu") -> nn.Module:
    with SEED_LOCK:
        torch.manual_seed(0)
        return _MLP().double().to(device)


def _train(model: nn.Module, forward, batches, device: str = "cpu") -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in batches:
        loss_fn(forward(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_tensor_parallel(backend, device: str = "cpu", compiler: str = COMPILER):
    torch._dynamo.reset()
    graphs = _graphs()
    model = TensorParallelModel(_mlp(device), backend, plan={"fc1": "column", "fc2": "row"})
    _train(model, torch.compile(model, backend=compiler), global_batches(STEPS, BATCH), device)
    return {name: value.cpu() for name, value in model.gather_full_parameters().items()}, _graphs() - graphs


def test_tensor_parallel_compiled_whole_equals_dense(pool):
    dense = _mlp()
    _train(dense, dense, global_batches(STEPS, BATCH))
    for params, graphs in pool.run(_train_tensor_parallel):
        for name, value in dense.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)
        assert graphs > 0, "nothing was compiled"


def _train_pipeline(backend, schedule: str, device: str = "cpu", compiler: str = COMPILER):
    """Rank function: a pipeline of compiled blocks, three Adam steps through ``train_step``;
    (this rank's parameters by name, on the CPU; graphs Dynamo made on this rank)."""
    torch._dynamo.reset()
    graphs = _graphs()
    model = PipelineParallelModel(_compiled_as(build_model().to(device), "blocks", compiler), backend,
                                  num_microbatches=2, schedule=schedule)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in global_batches(STEPS, BATCH):
        model.train_step((x.to(device), y.to(device)), loss_fn, optimizer)
    return {lp.name: lp.param.detach().cpu() for lp in model.local_parameters}, _graphs() - graphs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_of_compiled_blocks_equals_one_process(pool, schedule):
    expected = reference_run(global_batches(STEPS, BATCH))[-1]
    seen = set()
    for params, graphs in pool.run(functools.partial(_train_pipeline, schedule=schedule)):
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-10, msg=name)
        seen |= params.keys()
        assert graphs > 0, "nothing was compiled"
    assert seen == expected.keys()


def _ring_compiled(backend):
    """Rank function: this rank's slice of compiled ring attention's output and input gradients."""
    from attention import RingDilatedAttention
    torch._dynamo.reset()
    q, k, v, grad = _ring_inputs()
    part = slice(backend.rank * 8, (backend.rank + 1) * 8)
    mine = [t[:, part].detach().requires_grad_() for t in (q, k, v)]
    ring = RingDilatedAttention((4, 16), (1, 2), backend=backend)
    out = torch.compile(lambda *t: ring(*t, is_causal=True), backend=COMPILER)(*mine)
    out.backward(grad[:, part])
    return out.detach(), [t.grad for t in mine]


def _ring_inputs():
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(2, 16, 4, 4, dtype=torch.float64, generator=generator) for _ in range(4)]


def test_ring_attention_compiled_keeps_its_exchange(pool):
    """Compiled, the ring's keys still come from the other rank: it is not run as the local
    operator ([Note: dilated attention as an operator] in attention/compiled_op.py)."""
    from attention import DilatedAttention
    q, k, v, grad = _ring_inputs()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = DilatedAttention((4, 16), (1, 2))(*inputs, is_causal=True)
    dense.backward(grad)
    for rank, (out, grads) in enumerate(pool.run(_ring_compiled)):
        part = slice(rank * 8, (rank + 1) * 8)
        torch.testing.assert_close(out, dense[:, part].detach(), rtol=0, atol=1e-10)
        for got, full in zip(grads, inputs):
            torch.testing.assert_close(got, full.grad[:, part], rtol=0, atol=1e-10)


def test_pipeline_refuses_a_compiled_module_saying_what_to_compile():
    def run(backend):
        PipelineParallelModel(torch.compile(build_model(), backend=COMPILER), backend, num_microbatches=2)

    with pytest.raises(ConfigError, match=r"torch\.compile'd module.*block\.compile\(\)"):
        spawn(run, WORLD)


def test_dynamo_skips_distframe_only_once_imported():
    """Importing distframe must not import Dynamo (1-2 s); the first torch.compile puts the
    package on the skip list, with attention's kernels; the LM and its blocks (the user's model)
    stay traceable, and so do DilatedAttention's forward and the operator it calls when compiled."""
    script = textwrap.dedent("""
        import os, sys
        import torch
        import distframe, attention
        assert "torch._dynamo" not in sys.modules, "importing distframe imported Dynamo"
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
        from torch._dynamo import trace_rules
        root = os.path.dirname(distframe.__file__)
        assert trace_rules.check_file(os.path.join(root, "models", "base.py")).skipped
        ours = os.path.dirname(attention.__file__)
        for name in ("uncompiled", "function", "plan", "kernel", "ring", "block_sparse", "recompute"):
            assert trace_rules.check_file(os.path.join(ours, name + ".py")).skipped, name
        for name in ("model", "multihead", "dilated", "compiled_op"):
            assert not trace_rules.check_file(os.path.join(ours, name + ".py")).skipped, name
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
