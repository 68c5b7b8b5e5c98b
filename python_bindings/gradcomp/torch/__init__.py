# SPDX-License-Identifier: Apache-2.0
"""PyTorch DDP communication hooks backed by gradcomp's compressed allreduce plans.

One line in a DDP script::

    state, hook = gradcomp.torch.hook("topk", ratio=0.001)
    ddp_model.register_comm_hook(state, hook)

Compressors: ``"allreduce"`` (plain, through our driver), ``"fp16"`` / ``"bf16"`` (cast),
``"topk"`` (Deep Gradient Compression: residual, momentum correction, clipping, warm-up),
``"randomk"``, ``"onebit"`` (two-phase compressed allreduce with worker and server error) and
``"powersgd"``. The hooks run gradcomp plans over any torch.distributed process group (gloo on
CPU, NCCL on GPU) asynchronously: they return a ``torch.futures.Future`` chained with ``then``.

Bucket state. DDP rebuilds its buckets once, after the first iteration. Like PyTorch's PowerSGD
hook, a gradcomp hook runs a plain allreduce for the first ``start_iter`` iterations (default 2 for
the stateful compressors) and creates per-bucket state (residuals, momenta, Q, errors) at the
first compressed step, keyed by ``bucket.index()``. A bucket whose size or dtype changes after
that is an error (a silent re-initialisation would drop error-feedback memory).

Momentum. With ``momentum > 0`` the top-k hook applies DGC's momentum correction itself; the
optimizer must then not apply momentum again: use ``torch.optim.SGD(..., momentum=0)`` (see
:func:`dgc_optimizer`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

import gradcomp
from gradcomp import _C

from ._driver import PlanStats, launch, run_async, run_sync  # noqa: F401

__all__ = ["hook", "GradcompState", "dgc_optimizer", "COMPRESSORS"]

log = logging.getLogger("gradcomp")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _dtype_name(t: torch.Tensor) -> str:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"gradcomp hooks take float32/float16/bfloat16 gradients, got {t.dtype}") from None


def _stream_of(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _device_of(t: torch.Tensor) -> Tuple[str, int]:
    if t.is_cuda:
        if not gradcomp.built_with_cuda():
            raise RuntimeError(
                "gradcomp was built without CUDA (no nvcc at build time) but the gradient is a "
                "CUDA tensor; reinstall with CUDA available, or train on CPU")
        return "cuda", t.device.index or 0
    return "cpu", 0


# ------------------------------------------------------------------------------------------------
class _Family:
    """How one compressor builds and feeds its plan."""

    name = ""
    stateful = False
    defaults: Dict[str, Any] = {}

    def validate(self, opts: Dict[str, Any]) -> None:
        unknown = set(opts) - set(self.defaults)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for compressor {self.name!r}; "
                             f"known: {sorted(self.defaults)}")

    def make(self, opts, bucket, world: int, tensor_id: int):
        raise NotImplementedError

    def begin(self, plan, bucket) -> None:
        buf = bucket.buffer()
        plan.begin(buf, _stream_of(buf))


class _Allreduce(_Family):
    name = "allreduce"

    def make(self, opts, bucket, world, tensor_id):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        return _C.DenseAllreducePlan(buf.numel(), _dtype_name(buf), world, device=dev,
                                     device_index=idx, stream=_stream_of(buf))


class _Cast(_Family):
    def __init__(self, wire: str):
        self.name = wire
        self.wire = {"fp16": "float16", "bf16": "bfloat16"}[wire]

    def make(self, opts, bucket, world, tensor_id):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        return _C.CastAllreducePlan(buf.numel(), _dtype_name(buf), self.wire, world, device=dev,
                                    device_index=idx, stream=_stream_of(buf))


class _TopK(_Family):
    name = "topk"
    stateful = True
    defaults = dict(ratio=0.001, method="sampled", momentum=0.0, nesterov=False,
                    momentum_masking=True, clip_norm=0.0, warmup_ratios=(), warmup_steps=0,
                    value_dtype="float32", error_feedback=True, check_finite=True, seed=0,
                    route="auto", latency_s=20e-6, bandwidth_Bps=5e9)

    def validate(self, opts):
        super().validate(opts)
        r = opts.get("ratio", self.defaults["ratio"])
        if not (0.0 < float(r) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {r}")

    def make(self, opts, bucket, world, tensor_id):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        o["warmup_ratios"] = list(o["warmup_ratios"])
        return _C.TopKAllreducePlan(buf.numel(), world, grad_dtype=_dtype_name(buf), device=dev,
                                    device_index=idx, stream=_stream_of(buf), tensor_id=tensor_id,
                                    **o)


class _RandomK(_Family):
    name = "randomk"
    stateful = True
    defaults = dict(ratio=0.01, value_dtype="float32", error_feedback=True, check_finite=True,
                    seed=0)

    def validate(self, opts):
        super().validate(opts)
        r = opts.get("ratio", self.defaults["ratio"])
        if not (0.0 < float(r) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {r}")

    def make(self, opts, bucket, world, tensor_id):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        return _C.RandomKAllreducePlan(buf.numel(), world, grad_dtype=_dtype_name(buf), device=dev,
                                       device_index=idx, stream=_stream_of(buf),
                                       tensor_id=tensor_id, **o)


class _OneBit(_Family):
    name = "onebit"
    stateful = True
    defaults = dict(scaling="sign_l1", error_feedback=True, check_finite=True)

    def make(self, opts, bucket, world, tensor_id):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        return _C.OneBitAllreducePlan(buf.numel(), world, grad_dtype=_dtype_name(buf), device=dev,
                                      device_index=idx, stream=_stream_of(buf), **o)


class _PowerSGD(_Family):
    name = "powersgd"
    stateful = True
    defaults = dict(rank=1, min_compression_rate=2.0, use_error_feedback=True, warm_start=True,
                    orthogonalization_epsilon=0.0, seed=0, orthogonalization="auto")

    def validate(self, opts):
        super().validate(opts)
        r = opts.get("rank", self.defaults["rank"])
        if int(r) < 1 or int(r) != r:
            raise ValueError(f"rank must be an integer >= 1, got {r}")

    def make(self, opts, bucket, world, tensor_id):
        grads = bucket.gradients()
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        shapes = [list(g.shape) for g in grads]
        st = _C.PowerSGDState(shapes, grad_dtype=_dtype_name(buf), device=dev, device_index=idx,
                              stream=_stream_of(buf), **o)
        return _C.PowerSGDPlan(st, world)

    def begin(self, plan, bucket):
        grads = bucket.gradients()
        plan.begin(grads, _stream_of(bucket.buffer()))


COMPRESSORS = {f.name: f for f in (_Allreduce(), _Cast("fp16"), _Cast("bf16"), _TopK(),
                                   _RandomK(), _OneBit(), _PowerSGD())}


# ------------------------------------------------------------------------------------------------
class _Bucket:
    __slots__ = ("plan", "numel", "dtype", "steps")

    def __init__(self, plan, numel, dtype):
        self.plan, self.numel, self.dtype, self.steps = plan, numel, dtype, 0


class GradcompState:
    """State of a gradcomp DDP hook: options, per-bucket plans, iteration, statistics.

    Pickling (``__getstate__``) and :meth:`state_dict` keep everything but the process group, so a
    checkpoint restores residuals, momenta, Q and errors exactly.
    """

    def __init__(self, compressor: str, process_group=None, start_iter: Optional[int] = None,
                 log_every: int = 0, **options):
        if compressor not in COMPRESSORS:
            raise ValueError(f"unknown compressor {compressor!r}; choose one of {sorted(COMPRESSORS)}")
        fam = COMPRESSORS[compressor]
        fam.validate(options)
        self.compressor = compressor
        self.options = dict(options)
        self.process_group = process_group
        self.start_iter = (2 if fam.stateful else 0) if start_iter is None else int(start_iter)
        if self.start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.log_every = int(log_every)
        self.iter = 0
        self.buckets: Dict[int, _Bucket] = {}
        self.last_stats: Dict[int, Dict[str, Any]] = {}
        self.history: list = []  # per iteration: dense bytes, bytes sent, local seconds
        self._iter_acc = self._new_acc()
        self._pending_state: Optional[Dict[int, bytes]] = None

    # -- bookkeeping ------------------------------------------------------------------------------
    @staticmethod
    def _new_acc():
        return {"dense_bytes": 0, "bytes_sent": 0, "local_seconds": 0.0, "collectives": 0}

    @property
    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    def _record(self, bucket_index: int, dense: int, stats: PlanStats, route: str = "") -> None:
        s = {"dense_bytes": dense, "bytes_sent": stats.bytes_sent,
             "local_seconds": stats.local_seconds, "collectives": stats.collectives,
             "tags": list(stats.tags)}
        if route:
            s["route"] = route
        self.last_stats[bucket_index] = s
        acc = self._iter_acc
        acc["dense_bytes"] += dense
        acc["bytes_sent"] += stats.bytes_sent
        acc["local_seconds"] += stats.local_seconds
        acc["collectives"] += stats.collectives

    def _end_iteration(self) -> None:
        self.history.append(dict(self._iter_acc, iter=self.iter))
        if self.log_every and self.iter % self.log_every == 0:
            a = self._iter_acc
            log.info("gradcomp %s iter %d: %d -> %d bytes (%.1fx), %.2f ms local",
                     self.compressor, self.iter, a["dense_bytes"], a["bytes_sent"],
                     a["dense_bytes"] / max(1, a["bytes_sent"]), 1e3 * a["local_seconds"])
        self._iter_acc = self._new_acc()
        self.iter += 1

    def _bucket(self, bucket) -> _Bucket:
        buf = bucket.buffer()
        idx = bucket.index()
        b = self.buckets.get(idx)
        dt = _dtype_name(buf)
        if b is not None and (b.numel != buf.numel() or b.dtype != dt):
            raise RuntimeError(
                f"gradcomp: bucket {idx} changed from {b.numel} {b.dtype} elements to "
                f"{buf.numel()} {dt} after its compression state was created; increase "
                f"start_iter past DDP's bucket rebuild (iteration 1)")
        if b is None:
            fam = COMPRESSORS[self.compressor]
            plan = fam.make(self.options, bucket, self.world, tensor_id=idx)
            b = _Bucket(plan, buf.numel(), dt)
            if self._pending_state and idx in self._pending_state:
                plan.load_state_dict(self._pending_state.pop(idx))
            self.buckets[idx] = b
        return b

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Per-rank state: options, iteration and each bucket's compressor state (bytes)."""
        buckets = {}
        for i, b in self.buckets.items():
            if hasattr(b.plan, "state_dict"):
                buckets[i] = {"numel": b.numel, "dtype": b.dtype, "state": b.plan.state_dict()}
        return {"compressor": self.compressor, "options": dict(self.options),
                "start_iter": self.start_iter, "iter": self.iter,
                "world_size": self.world if dist.is_initialized() else None,
                "buckets": buckets}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; a different compressor, world size or bucket layout is an
        error, raised before anything changes."""
        if sd.get("compressor") != self.compressor:
            raise ValueError(f"state is for compressor {sd.get('compressor')!r}, this hook is "
                             f"{self.compressor!r}")
        ws = sd.get("world_size")
        if ws is not None and dist.is_initialized() and ws != self.world:
            raise ValueError(f"state was saved with world size {ws}, the process group has "
                             f"{self.world}")
        for i, b in sd["buckets"].items():
            cur = self.buckets.get(int(i))
            if cur is not None and (cur.numel != b["numel"] or cur.dtype != b["dtype"]):
                raise ValueError(f"bucket {i}: saved {b['numel']} {b['dtype']} elements, "
                                 f"the model has {cur.numel} {cur.dtype}")
        for i, b in sd["buckets"].items():
            cur = self.buckets.get(int(i))
            if cur is not None:
                cur.plan.load_state_dict(b["state"])
        self._pending_state = {int(i): b["state"] for i, b in sd["buckets"].items()
                               if int(i) not in self.buckets}
        self._pending_layout = {int(i): (b["numel"], b["dtype"]) for i, b in sd["buckets"].items()}
        self.iter = int(sd["iter"])
        self.start_iter = int(sd["start_iter"])

    def __getstate__(self):
        return {"compressor": self.compressor, "options": self.options,
                "log_every": self.log_every, "sd": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(d["compressor"], None, d["sd"]["start_iter"], d["log_every"], **d["options"])
        self.load_state_dict(dict(d["sd"], world_size=None))


def _hook(state: GradcompState, bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    if bucket.is_last() if hasattr(bucket, "is_last") else False:
        finish_iter = True
    else:
        finish_iter = False
    dense = buf.numel() * buf.element_size()
    world = state.world

    def done(stats: PlanStats, idx=bucket.index(), route=""):
        state._record(idx, dense, stats, route)

    if state.iter < state.start_iter:
        plan = COMPRESSORS["allreduce"].make({}, bucket, world, bucket.index())
        COMPRESSORS["allreduce"].begin(plan, bucket)
        fut = run_async(plan, state.process_group, lambda: buf, done=done)
    else:
        b = state._bucket(bucket)
        COMPRESSORS[state.compressor].begin(b.plan, bucket)
        b.steps += 1
        fut = run_async(b.plan, state.process_group, lambda: buf, done=done)
    if finish_iter:
        state._end_iteration()
    return fut


def hook(compressor: str, process_group=None, start_iter: Optional[int] = None,
         log_every: int = 0, **options):
    """Returns ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Example::

        state, h = gradcomp.torch.hook("powersgd", rank=4)
        model.register_comm_hook(state, h)

    Raises ValueError for an unknown compressor name or option, ratio outside (0, 1], rank < 1.
    """
    return GradcompState(compressor, process_group, start_iter, log_every, **options), _hook


def dgc_optimizer(params, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.SGD:
    """SGD without momentum, for use with the top-k hook's DGC momentum correction (the hook
    already accumulates momentum before compression; applying it again would square it)."""
    if kwargs.get("momentum", 0.0):
        raise ValueError("with DGC momentum correction the optimizer must not apply momentum; "
                         "set momentum on the hook instead")
    return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay, **kwargs)
