# SPDX-License-Identifier: Apache-2.0
"""The compressor families behind gradcomp.torch.hook: each builds its C++ plan for a DDP bucket
(``make``), starts a step on the bucket (``begin``) and hands back the averaged bucket
(``result``). COMPRESSORS maps the names ``hook`` accepts to them."""
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

import gradcomp
from gradcomp import _C

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

    def validate(self, opts: Dict[str, Any], world: int = 1, group=None) -> None:
        """Refuses unknown options, then builds this compressor's plan for a small CPU bucket
        from the options: the bindings parse them into the C++ configuration, whose validate()
        applies the rules of the real first compressed step. One copy of the rules, in C++, and
        an option added to a plan's constructor is checked here with no change."""
        unknown = set(opts) - set(self.defaults)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for compressor {self.name!r}; "
                             f"known: {sorted(self.defaults)}")
        try:
            self.make(opts, _ProbeBucket(), world, 0, group)
        except TypeError as e:  # nanobind: an option of the wrong type
            raise ValueError(f"invalid option for compressor {self.name!r}: {e}") from e

    def make(self, opts, bucket, world: int, tensor_id: int, group=None):
        raise NotImplementedError

    def begin(self, plan, bucket) -> None:
        buf = bucket.buffer()
        plan.begin(buf, _stream_of(buf))

    def result(self, plan, bucket) -> torch.Tensor:
        return bucket.buffer()


class _ProbeBucket:
    """The bucket _Family.validate() builds a plan for: one 8 x 8 fp32 CPU tensor."""

    def __init__(self):
        self._grad = torch.zeros(8, 8)

    def buffer(self):
        return self._grad.view(-1)

    def gradients(self):
        return [self._grad]


class _Allreduce(_Family):
    name = "allreduce"

    def make(self, opts, bucket, world, tensor_id, group=None):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        return _C.DenseAllreducePlan(buf.numel(), _dtype_name(buf), world, device=dev,
                                     device_index=idx, stream=_stream_of(buf))


class _Cast(_Family):
    # route: "allreduce" (one allreduce in fp16/bf16), "reduce_scatter" (all-to-all of fp16/bf16
    # chunks, rank-ordered fp32 sum, allgather: the same bytes on the wire, but the backend only
    # moves bytes) or "auto": reduce_scatter on gloo, whose half-precision sums are slow on CPU
    # (and which has no bf16 sum in torch 1.13, so bf16 would travel as fp32), else allreduce.
    defaults = dict(route="auto")

    def __init__(self, wire: str):
        self.name = wire
        self.wire = {"fp16": "float16", "bf16": "bfloat16"}[wire]

    def make(self, opts, bucket, world, tensor_id, group=None):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        route = dict(self.defaults, **opts)["route"]
        if route == "auto":
            if dist.is_initialized():
                rs = dist.get_backend(group) == "gloo"
            else:  # the option probe before any process group: decide by device
                rs = dev == "cpu"
            route = "reduce_scatter" if rs else "allreduce"
        return _C.CastAllreducePlan(buf.numel(), _dtype_name(buf), self.wire, world, device=dev,
                                    device_index=idx, stream=_stream_of(buf), route=route)


class _TopK(_Family):
    name = "topk"
    stateful = True
    # clip_norm: the global threshold; each of N ranks clips its gradient at clip_norm N^-1/2
    # (clip_scaling="sqrt_world", DGC) or at clip_norm itself (clip_scaling="none")
    defaults = dict(ratio=0.001, method="sampled", momentum=0.0, nesterov=False,
                    momentum_masking=True, clip_norm=0.0, clip_scaling="sqrt_world",
                    warmup_ratios=(), warmup_steps=0,
                    value_dtype="float32", error_feedback=True, check_finite=True, seed=0,
                    sample_rate=0.01, route="auto", latency_s=20e-6, bandwidth_Bps=5e9)

    plan_class = "TopKAllreducePlan"

    def make(self, opts, bucket, world, tensor_id, group=None):
        """The top-k or random-k plan (plan_class) for the bucket, with DGC's options."""
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        o["warmup_ratios"] = list(o["warmup_ratios"])
        return getattr(_C, self.plan_class)(buf.numel(), world, grad_dtype=_dtype_name(buf),
                                            device=dev, device_index=idx, stream=_stream_of(buf),
                                            tensor_id=tensor_id, **o)


class _RandomK(_TopK):
    name = "randomk"
    stateful = True
    # momentum > 0: DGC's momentum correction and masking (use dgc_optimizer: no optimizer
    # momentum). Error-feedback random-k under an optimizer with momentum diverges (issue 17).
    defaults = dict(ratio=0.01, momentum=0.0, nesterov=False, momentum_masking=True,
                    clip_norm=0.0, clip_scaling="sqrt_world", warmup_ratios=(), warmup_steps=0,
                    value_dtype="float32",
                    error_feedback=True, check_finite=True, seed=0)

    plan_class = "RandomKAllreducePlan"


class _OneBit(_Family):
    name = "onebit"
    stateful = True
    # block_size: elements per scale. One scale per server chunk (block_size=0, the 1-bit Adam
    # paper's form) lets layers of very different gradient size share a scale and collapsed
    # training (issue 16); 128 costs 0.25 bit per element (25.6x fewer bytes on the wire than a
    # ring allreduce of fp32).
    # scaling: "sign_l2" (the block's RMS) rather than the L1 mean: sign compression moves a
    # coordinate by at most the scale per step, so a large gradient waits in error feedback; the
    # larger RMS scale drains it sooner and trained better on Fashion-MNIST (experiments/results/
    # fashion_mnist_accuracy_2026-11-24.md).
    # momentum > 0: each rank compresses its momentum u = m u + g (use dgc_optimizer: the
    # optimizer applies none); the smoother momentum loses far less to the sign.
    # rotate: each block of block_size elements goes through a fixed randomized Hadamard rotation
    # before the sign and back after the average (DRIVE). A weight gradient's block holds a few
    # large entries, of which sign + one scale keeps little; rotated blocks are near-Gaussian and
    # lose 0.36 (L1 scale) to 0.40 (L2) of their energy per phase. Same bytes; closed most of the gap to plain DDP
    # on Fashion-MNIST (issue 16, experiments/results/fashion_mnist_onebit_rotation_2026-11-24.md).
    defaults = dict(scaling="sign_l2", error_feedback=True, check_finite=True, block_size=128,
                    momentum=0.0, rotate=True)

    def make(self, opts, bucket, world, tensor_id, group=None):
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        # the plan averages in place (the bucket receives the result): no fp32 copy of the bucket
        return _C.OneBitAllreducePlan(buf.numel(), world, rank, device=dev, device_index=idx,
                                      stream=_stream_of(buf), **o)

    def begin(self, plan, bucket):
        buf = bucket.buffer()
        plan.begin(buf, None, _stream_of(buf))


class _PowerSGD(_Family):
    name = "powersgd"
    stateful = True
    defaults = dict(rank=1, min_compression_rate=2.0, use_error_feedback=True, warm_start=True,
                    orthogonalization_epsilon=0.0, seed=0, orthogonalization="auto",
                    check_finite=True)

    def make(self, opts, bucket, world, tensor_id, group=None):
        grads = bucket.gradients()
        buf = bucket.buffer()
        dev, idx = _device_of(buf)
        o = dict(self.defaults)
        o.update(opts)
        shapes = [list(g.shape) if g.dim() > 0 else [1] for g in grads]
        st = _C.PowerSGDState(shapes, grad_dtype=_dtype_name(buf), device=dev, device_index=idx,
                              stream=_stream_of(buf), first_tensor_id=tensor_id * 65536, **o)
        return _C.PowerSGDPlan(st, world)  # keeps st alive; state_dict() is the state's

    def begin(self, plan, bucket):
        grads = [g.reshape(-1) if g.dim() == 0 else g for g in bucket.gradients()]
        plan.begin(grads, _stream_of(bucket.buffer()))


COMPRESSORS = {f.name: f for f in (_Allreduce(), _Cast("fp16"), _Cast("bf16"), _TopK(),
                                   _RandomK(), _OneBit(), _PowerSGD())}


# ------------------------------------------------------------------------------------------------
