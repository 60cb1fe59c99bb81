"""GradientCompressionOptimizer: DDP whose per-bucket gradient all_reduce becomes
compress -> exchange -> decompress, with error feedback.

The compressors (the math) live in ``compression.py``; this file moves their payloads. The
optimizer plugs into ``DDPModel.register_comm_hook``, so compression runs per gradient bucket as
DDP's all_reduce would, started from the gradient hooks during backward and completed in
``synchronize_gradients()``.

[Note: error feedback] For a lossy compressor each rank keeps, per parameter, the residual e:
it compresses g + e instead of g, and keeps e' = (g + e) - sent, where ``sent`` is what its
payload decompresses to (its own contribution to the sum). So after T steps
sum(sent) + e_T = sum(g) exactly (up to rounding): nothing is dropped, only delayed. Residuals
of fp16 and bf16 parameters are float32 (``compression_residuals``, [Note: residual dtype]).

[Note: shares on the wire] Summable payloads (fp16, bf16) are added on the wire in (or
rounded once to) the wire dtype, so a rank sends its share of the mean, g / p with p the power of
two >= world size, not g: the sum of W shares of gradients that each fit fp16 is at most 65504
and cannot overflow; dividing by a power of two is exact, and the sum is scaled by p / W in
float32 at least (in fp16 itself the sum times p would overflow where the mean fits). The cost
is at the bottom of the range: a share below fp16's smallest subnormal (2**-24) is lost where g
itself was not, and error feedback keeps it for a later step.
Summing whole gradients loses the top instead (a sum past 65504 is inf although the mean fits,
and a GradScaler then skips the step and halves its scale for nothing); under loss scaling the
gradients sit near the top of the range, so the shares lose less. A share past 65504 still
becomes inf, as does a mean past it: never a finite wrong value. (Casting first and dividing in
fp16, torch's fp16_compress_hook, overflows on g past 65504 and rounds twice.)

[Note: skipped steps] The new residuals (and PowerSGD's new warm-start factors) are staged when
a bucket is exchanged and become current when ``step()`` applies the gradients they belong to;
``zero_grad()`` without a step discards them. So a backward whose gradients are thrown away
(GradScaler skipping a step whose gradients overflowed, to inf/nan residuals that would poison
every later step) leaves no trace. A second synchronised backward before the step (accumulation
outside ``no_sync``) keeps the first one's, as its gradients stay in the buffer.

[Note: residuals under loss scaling] Under a GradScaler the hook sees gradients times the loss
scale S, so residuals are kept in units of S. When the scale moves to S' (growth, or backing off
after an overflow) they must be multiplied by S'/S before the next backward adds them, or the
part still to be sent is off by that factor. ShardedGradScaler.update() tells every optimizer it
stepped this iteration (``loss_scale_changed``); a plain GradScaler cannot, so with error
feedback this optimizer refuses it (``_step_supports_amp_scaling``: torch then hands ``step()``
the found-inf flag, and the base class refuses a flag that ShardedGradScaler did not agree).
A checkpoint holds the residuals with the scale they are in, not the scaler: the first step
after a load at another scale is refused (``compression_residuals.ResidualScale``). That scale is
the scaler's at the step, which ShardedGradScaler.step passes to ``gradients_scaled_by``: the
``grad_scale`` torch hands ``step()`` is None once ``unscale_`` has run (taken for no scaling,
scale 1, it refused a resume with the right scaler and let one at another scale through).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distframe.backends.protocol import ICommunicationBackend
from distframe.backends.reduction import power_of_two_at_least
from distframe.backends.types import ReduceOp, Work
from distframe.errors import ConfigError
from distframe.models.ddp import DDPModel
from distframe.models.gradient_buckets import GradBucket
from distframe.models.sharded_state import RangeReader
from distframe.optimizers.base import ShardedOptimizerBase, state_reader
from distframe.optimizers.compression import Compressor, Payload, PowerSGDCompressor
from distframe.optimizers.compression_residuals import (ResidualScale, add_residual, load_residuals,
                                                        residual_dtype)
from distframe.optimizers.compression_state import (RECORD, compression_pieces, compression_record,
                                                    load_compressor_state, saved_record)
from distframe.optimizers.compressor_checks import (check_compress_result, check_compress_signature,
                                                    check_same_compression, claim)


class _Then(Work):
    """``wait()`` waits for ``works`` and returns ``finish(results)`` (computed once)."""

    def __init__(self, works: list[Work], finish: Callable[[list[Any]], Any]) -> None:
        self._works, self._finish = works, finish
        self._done, self._result = False, None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._result = self._finish([w.wait(timeout) for w in self._works])
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done


def _split(flat: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    return list(flat.split(numels)) if numels else []


class GradientCompressionOptimizer(ShardedOptimizerBase):
    """Data-parallel training of a ``DDPModel`` with compressed gradient exchange.

    ``compressor``: a ``distframe.optimizers.compression.Compressor``. ``error_feedback``
    (default True) keeps a per-parameter residual for lossy compressors (ignored for lossless ones):
    memory of one more copy of the parameters, in float32 for fp16 and bf16 parameters (twice
    their bytes; see [Note: residual dtype] in ``compression_residuals.py``).

    Construction (collective: one all_gather) compares every rank's settings (optimizer, param
    groups, compressor, error feedback) and raises ConfigError on every rank, naming what differs.
    Collectives per gradient bucket (each rank ends with the same averaged gradient):
    identity, or PowerSGD before its ``start_iter``: one ``all_reduce(AVG)``, exactly DDP's;
    fp16/bf16: one ``all_reduce(SUM)`` of the cast shares of the bucket (an "all_reduce" compressor
    of one's own: of every payload part, one per wire dtype); int8/top-k: one
    ``all_gather`` per payload part (int8 values and scales; top-k values and indices), then
    every rank decompresses every rank's payload and sums them in rank order; PowerSGD: one
    ``all_reduce(AVG)`` of the uncompressible parameters and one ``all_reduce(SUM)`` of the P
    factors (asynchronous, during backward), then one ``all_reduce(SUM)`` of the Q factors when the
    bucket is waited for (factors in float32 at least: see ``PowerSGDCompressor``).

    Loss scaling: every rank decompresses the same sum, so its ranks agree on inf/nan (see
    [Note: skipped steps]); with error feedback use ``ShardedGradScaler``, whose ``update()``
    rescales the residuals (a plain ``torch.amp.GradScaler`` is refused at ``step()``: see
    [Note: residuals under loss scaling]); without it, or for lossless compressors, either will do.

    The model compresses while this optimizer is its optimizer: building another for it (say
    ``DDPOptimizer``) ends the hook, and DDP's all_reduce returns (``DDPModel.attach_optimizer``).

    ``state_dict()`` adds, beside the wrapped optimizer's pieces, this rank's residuals
    (``compression.residual.rank<r>/<name>@0``) and compressor state (int8's rounding generator),
    on rank 0 PowerSGD's warm-start factors, the step count and the residuals' loss scale (the same
    on every rank: see [Note: state written once] in ``compression_state.py``), and on every rank
    the record with which a rank loads its own state back ([Note: one rank's state_dict]).
    """

    model_class = DDPModel

    def __init__(self, model: DDPModel, optimizer: Any, *, compressor: Compressor,
                 error_feedback: bool = True, **optimizer_kwargs: Any) -> None:
        if not isinstance(compressor, Compressor):
            raise ConfigError(f"GradientCompressionOptimizer.compressor must be a Compressor from "
                              f"distframe.optimizers.compression (e.g. FP16Compressor()), got {compressor!r:.60}")
        if not isinstance(error_feedback, bool):
            raise ConfigError("GradientCompressionOptimizer.error_feedback must be True or False")
        check_compress_signature(compressor)
        if not isinstance(model, self.model_class):  # before model.backend; the base class checks later
            raise ConfigError(f"{type(self).__name__} belongs with DDPModel, got {type(model).__name__}: "
                              "wrap the module first, as DDPModel(module, backend)")
        claim(compressor, model.backend)
        super().__init__(model, optimizer, **optimizer_kwargs)
        self.compressor = compressor
        compressor.bind(model.backend.rank)
        self.error_feedback = error_feedback and compressor.lossy
        self.iteration = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self._staged_residuals: dict[str, torch.Tensor] = {}
        self._rounding: dict[str, torch.Tensor] = {}  # add_residual's, until _keep_residual
        self._staged_warm: dict[str, torch.Tensor] = {}
        self._residual_scale = ResidualScale()
        self._scaler_scale: torch.Tensor | None = None  # see gradients_scaled_by
        # Before the hook: ranks built unlike would exchange payloads that do not fit together.
        check_same_compression(model.backend, self.wrapped_optimizer, compressor, self.error_feedback,
                               type(self).__name__)
        model.register_comm_hook(self._communicate, owner=self)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Residuals are in units of the loss scale (see [Note: residuals under loss scaling]):
        # GradScaler then hands step() its flag, and a plain one is refused there.
        return self.error_feedback

    def _needs_sharded_scaler_because(self) -> str:
        return ("keeps error-feedback residuals in units of the loss scale, and a plain "
                "torch.amp.GradScaler does not say when its scale changes (the residuals would join "
                "the next gradients at the old scale); ShardedGradScaler rescales them at update()")

    def loss_scale_changed(self, factor: torch.Tensor) -> None:
        """Called by ShardedGradScaler.update() with new scale / old scale (a one-element tensor):
        residuals, current and staged, move to the new scale."""
        self._residual_scale.changed(factor)
        if factor.device.type == "cpu" and float(factor) == 1.0:
            return
        for residuals in (self.residuals, self._staged_residuals):
            for residual in residuals.values():
                residual.mul_(factor.to(residual.device, residual.dtype))

    def gradients_scaled_by(self, scale: torch.Tensor) -> None:
        """Called by ShardedGradScaler.step, before ``step()``, with the loss scale this step's
        backward ran at: torch hands ``step()`` ``grad_scale=None`` once ``unscale_`` has run."""
        self._scaler_scale = scale

    def _apply_grad_scaler(self) -> bool:
        scaler_scale, self._scaler_scale = self._scaler_scale, None
        found_inf = getattr(self, "found_inf", None)
        # A plain GradScaler's flag is refused by the base class, whatever the scale.
        if self.error_feedback and (found_inf is None or self._scaler_flags_agreed):
            # The scale this step's residuals are in (checked after a load); None: no scaler (1).
            scale = scaler_scale if scaler_scale is not None else getattr(self, "grad_scale", None)
            self._residual_scale.stepping(None if found_inf is None else scale, type(self).__name__)
        return super()._apply_grad_scaler()

    def _step(self, closure: Any = None) -> Any:
        # Not reached for a step a GradScaler skips: its staged residuals stay out (and the
        # iteration count stays), as when a plain GradScaler never calls step().
        loss = super()._step(closure)
        # With find_unused_parameters=True a parameter no rank used keeps .grad None and the
        # optimizer skips it, so what its residual sent this step was never applied: it keeps
        # the residual it had (every rank agrees which parameters those are).
        for name, param in self.model.wrapped_model.named_parameters():
            if param.grad is None:
                self._staged_residuals.pop(name, None)
                self._staged_warm.pop(name, None)
        self._make_current()
        self.iteration += 1
        return loss

    def gradients_cleared(self) -> None:
        """The model's gradients were cleared (by this optimizer's ``zero_grad`` or the model's):
        residuals and warm-start factors staged since the last step go with them (see
        [Note: skipped steps])."""
        self._staged_residuals.clear()
        self._staged_warm.clear()
        self._rounding.clear()

    def _make_current(self, names: list[str] | None = None) -> None:
        """Staged residuals and warm-start factors (of ``names``, or all) become current."""
        for name in list(self._staged_residuals) if names is None else names:
            if name in self._staged_residuals:
                self.residuals[name] = self._staged_residuals.pop(name)
        for name in list(self._staged_warm) if names is None else names:
            if name in self._staged_warm:
                self.compressor.remember(name, self._staged_warm.pop(name))  # type: ignore[attr-defined]

    # ---- the comm hook -----------------------------------------------------------------------
    def _communicate(self, backend: ICommunicationBackend, bucket: GradBucket) -> Work:
        compressor = self.compressor
        plain = compressor.exchange == "powersgd" and not compressor.is_active(self.iteration)
        if not compressor.lossy or plain:
            return backend.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)
        names = [e.name for e in bucket.space.entries]
        views = bucket.space.views(bucket.buffer)
        self._make_current(names)  # staged by an earlier backward of this step: its gradients stay
        if self.error_feedback:
            for name, view in zip(names, views):
                if name in self.residuals:
                    lost = add_residual(view, self.residuals[name])  # see [Note: residual dtype]
                    if lost is not None:
                        self._rounding[name] = lost
        if compressor.exchange == "all_reduce":
            return self._exchange_summable(backend, names, views)
        if compressor.exchange == "all_gather":
            return self._exchange_gathered(backend, names, views)
        if compressor.exchange == "powersgd":
            return self._exchange_powersgd(backend, names, views)
        raise ConfigError(f"{compressor!r} has exchange={compressor.exchange!r}; a compressor's "
                          "exchange is 'all_reduce', 'all_gather' or 'powersgd'")

    def _keep_residual(self, name: str, given: torch.Tensor, sent: torch.Tensor) -> None:
        rounding = self._rounding.pop(name, None)
        if self.error_feedback:
            wide = residual_dtype(given.dtype)  # (for float32 and float64, no copy)
            residual = given.to(wide) - sent.to(wide)
            self._staged_residuals[name] = residual if rounding is None else residual.add_(rounding)

    def _compress(self, tensor: torch.Tensor, name: str) -> tuple[Any, Any]:
        """``compressor.compress``, its result checked: (a tuple of tensors, ctx)."""
        return check_compress_result(self.compressor, self.compressor.compress(tensor, key=name))

    def _exchange_summable(self, backend: ICommunicationBackend, names: list[str],
                           views: list[torch.Tensor]) -> Work:
        """Payloads that add up: every part of every payload summed, one all_reduce(SUM) per wire
        dtype (one for fp16 and bf16), each rank sending its share of the mean (see
        [Note: shares on the wire]); ``decompress`` gets the summed parts."""
        world = backend.world_size
        share = power_of_two_at_least(world)
        compressed = [self._compress(v / share, n) for n, v in zip(names, views)]
        for (name, view), (payload, ctx) in zip(zip(names, views), compressed):
            # Exact (a power of two); not in place: for fp16 gradients the payload is what decompress returns.
            sent = self.compressor.decompress(payload, ctx) * share
            self._keep_residual(name, view, sent)
        parts = [part for payload, _ in compressed for part in payload]
        by_dtype: dict[torch.dtype, list[int]] = {}  # wire dtype -> the parts it carries
        for k, part in enumerate(parts):
            by_dtype.setdefault(part.dtype, []).append(k)
        wires = [torch.cat([parts[k].reshape(-1) for k in ks]) for ks in by_dtype.values()]

        def finish(results: list[Any]) -> None:
            summed: list[torch.Tensor] = list(parts)
            for ks, wire in zip(by_dtype.values(), wires):
                for k, piece in zip(ks, _split(wire, [parts[k].numel() for k in ks])):
                    summed[k] = piece.view(parts[k].shape)
            first = 0
            for view, (payload, ctx) in zip(views, compressed):
                total = self.compressor.decompress(tuple(summed[first:first + len(payload)]), ctx)
                first += len(payload)
                # At least float32: fp16 gradients' sum of shares times p would pass 65504 where
                # the mean fits.
                wide = total.to(torch.promote_types(total.dtype, torch.float32))
                view.copy_(wide.mul_(share).div_(world))
        return _Then([backend.all_reduce(wire, ReduceOp.SUM, async_op=True) for wire in wires], finish)

    def _exchange_gathered(self, backend: ICommunicationBackend, names: list[str],
                           views: list[torch.Tensor]) -> Work:
        """Payloads that do not add up: all_gather each part, decompress every rank's, sum."""
        compressed = [self._compress(v, n) for n, v in zip(names, views)]
        for (name, view), (payload, ctx) in zip(zip(names, views), compressed):
            self._keep_residual(name, view, self.compressor.decompress(payload, ctx))
        parts = len(compressed[0][0])
        sizes = [[payload[j].numel() for payload, _ in compressed] for j in range(parts)]
        wires = [torch.cat([payload[j].reshape(-1) for payload, _ in compressed]) for j in range(parts)]
        world = backend.world_size

        def finish(gathered: list[torch.Tensor]) -> None:
            per_rank = [g.view(world, -1) for g in gathered]  # part j: (world, its length)
            # At least float32: W fp16 contributions can pass 65504 where their mean fits.
            totals = [torch.zeros_like(v, dtype=torch.promote_types(v.dtype, torch.float32)) for v in views]
            for r in range(world):
                pieces = [_split(per_rank[j][r], sizes[j]) for j in range(parts)]
                for k, (_, ctx) in enumerate(compressed):
                    payload: Payload = tuple(pieces[j][k] for j in range(parts))
                    totals[k].add_(self.compressor.decompress(payload, ctx))
            for view, total in zip(views, totals):
                view.copy_(total.div_(world))
        return _Then([backend.all_gather(w, async_op=True) for w in wires], finish)

    def _exchange_powersgd(self, backend: ICommunicationBackend, names: list[str],
                           views: list[torch.Tensor]) -> Work:
        """Uncompressible tensors and P = M Q go out now; Q = M^T P goes out when waited for."""
        psgd: PowerSGDCompressor = self.compressor  # type: ignore[assignment]
        low = [k for k, v in enumerate(views) if psgd.compressible(v.shape)]
        full = [k for k, v in enumerate(views) if not psgd.compressible(v.shape)]
        works = []
        if full:
            flat_full = torch.cat([views[k].reshape(-1) for k in full])
            works.append(backend.all_reduce(flat_full, ReduceOp.AVG, async_op=True))
            for k in full:
                self._keep_residual(names[k], views[k], views[k])
        matrices = {k: psgd.as_matrix(views[k]).to(psgd.factor_dtype(views[k].dtype), copy=True) for k in low}
        ps = {k: psgd.project(matrices[k], psgd.warm_start(names[k], views[k].shape, matrices[k].dtype,
                                                                   views[k].device))
              for k in low}
        if low:
            flat_p = torch.cat([ps[k].reshape(-1) for k in low])
            works.append(backend.all_reduce(flat_p, ReduceOp.SUM, async_op=True))
        world = backend.world_size

        def finish(results: list[Any]) -> None:
            if full:
                for k, part in zip(full, _split(flat_full, [views[k].numel() for k in full])):
                    views[k].copy_(part.view(views[k].shape))
            if not low:
                return
            summed_p = _split(flat_p, [ps[k].numel() for k in low])
            p = {k: psgd.orthogonalize(part.view(ps[k].shape).clone()) for k, part in zip(low, summed_p)}
            q_local = {k: psgd.back_project(matrices[k], p[k]) for k in low}
            flat_q = torch.cat([q_local[k].reshape(-1) for k in low])
            backend.all_reduce(flat_q, ReduceOp.SUM)
            for k, part in zip(low, _split(flat_q, [q_local[k].numel() for k in low])):
                q_sum = part.view(q_local[k].shape)
                # In the factors' dtype, float32 at least, as the residual (see [Note: residual dtype])
                sent = psgd.approximate(p[k], q_local[k], views[k].shape)
                self._keep_residual(names[k], views[k], sent)
                self._staged_warm[names[k]] = q_sum / world
                views[k].copy_(psgd.approximate(p[k], q_sum, views[k].shape).div_(world))
        return _Then(works, finish)

    # ---- state -------------------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:  # residuals; PowerSGD's warm starts (copies' sizes)
        return [*self.residuals.values(), *self.compressor.state_dict().values()]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's pieces and this rank's compression state (see the class doc)."""
        state = super().state_dict()
        backend = self.model.backend
        own = compression_pieces(self.compressor, self.residuals, self.iteration, self._residual_scale,
                                 backend.rank)
        record = compression_record(self.compressor, self.residuals, self.iteration, self._residual_scale,
                                    backend.world_size)
        return {**state, "tensors": {**state["tensors"], **own}, RECORD: record}

    def load_state_dict(self, state: dict[str, Any], reader: RangeReader | None = None) -> None:
        """Loads the optimizer pieces, then this rank's residuals (under another world size see
        [Note: residuals across world sizes]), the compressor state and the step."""
        reader = reader or state_reader(state, type(self).__name__)
        super().load_state_dict(state, reader)
        record = saved_record(state, reader)
        # A checkpoint of another optimizer holds no step count: this optimizer's steps start
        # again, as a new one's would (not at the count of the steps the load abandons).
        self.iteration = 0 if record["step"] is None else int(record["step"])
        self.gradients_cleared()  # what was staged for the next step belongs to the abandoned ones
        params = dict(self.model.wrapped_model.named_parameters())
        backend = self.model.backend
        self.residuals = load_residuals(reader, reader.kinds(), params, backend.rank, backend.world_size,
                                        record["world_size"])
        self._residual_scale.load(record["loss_scale"])
        load_compressor_state(self.compressor, reader, params, backend.rank, record)
