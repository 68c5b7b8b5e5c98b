# SPDX-License-Identifier: Apache-2.0
"""The compressor families behind gradcomp.torch.hook: each builds its C++ plan for a DDP bucket
(``make``) and starts a step on the bucket (``begin``), which the plan averages in place.
COMPRESSORS maps the names ``hook`` accepts to them."""
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

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
    """One compressor of the hook: its C++ plan is built by _C.make_plan, which owns the option
    names, defaults and checks of every family (plan_defaults(name) lists them). The same code
    serves every family: the bucket is handed to the plan flat and averaged in place."""

    def __init__(self, traits: Dict[str, Any]):
        self.name: str = traits["name"]
        self.stateful: bool = traits["stateful"]
        # its plans read the bucket's tensor shapes (PowerSGD's matrices, random-k's dense_below)
        self.uses_shapes: bool = traits["uses_shapes"]
        self.defaults: Dict[str, Any] = _C.plan_defaults(self.name)
        self.aliases: Dict[str, str] = dict(traits["aliases"])  # {other spelling: option}

    def canonical(self, opts: Dict[str, Any]) -> Dict[str, Any]:
        """The options with every other accepted spelling renamed to the option it spells, so
        that what is saved, compared and digested does not depend on the spelling (a checkpoint
        saved with chunk_size=64 loads into a hook built with block_size=64). Both spellings
        given are left as they are: validate() refuses them, naming both."""
        out = dict(opts)
        for spelling, option in self.aliases.items():
            if spelling in out and option not in out:
                out[option] = out.pop(spelling)
        return out

    def validate(self, opts: Dict[str, Any], world: int = 1, group=None,
                 per_node: int = 0) -> None:
        """Builds this compressor's plan for a small CPU bucket from the options: C++ refuses an
        unknown option, a wrong type or a bad value with a ValueError, before any training step.
        (make_flat, not make: the probe bucket is not the user's, so nothing is said about it.)"""
        probe = _ProbeBucket()
        self.make_flat(opts, probe.buffer(), world, 0, group, self._shapes(probe),
                       per_node=per_node)

    def _shapes(self, bucket) -> Optional[List[List[int]]]:
        """The bucket's tensor shapes, for the families that use them."""
        if not self.uses_shapes:
            return None
        return [list(g.shape) for g in bucket.gradients()]

    def make(self, opts, bucket, world: int, tensor_id: int, group=None, per_node: int = 0):
        """The plan for a DDP bucket (or anything with buffer() and gradients()); per_node > 0:
        the two-level plan for nodes of per_node ranks."""
        shapes = self._shapes(bucket)
        plan = self.make_flat(opts, bucket.buffer(), world, tensor_id, group, shapes, per_node)
        if self.name == "randomk" and 0 < plan.numel == getattr(plan, "dense_numel", -1):
            self._warn_sent_whole(opts, shapes, tensor_id, group)
        return plan

    def _warn_sent_whole(self, opts, shapes: List[List[int]], bucket_id: int, group) -> None:
        """Random-k sends a bucket's tensors of fewer than dense_below elements whole; the plan
        says (dense_numel) when that is every tensor of the bucket, which is then not compressed
        at all. Say so once (rank 0, once per bucket: Python shows a warning's text once), since
        it shows otherwise only in the per-step byte counts."""
        if dist.is_initialized() and dist.get_rank(group) != 0:
            return
        dense_below = opts.get("dense_below", self.defaults["dense_below"])
        sizes = [math.prod(s) for s in shapes]
        warnings.warn(
            f"gradcomp randomk: every tensor of bucket {bucket_id} ({len(sizes)} tensors, "
            f"{sum(sizes)} elements, the largest {max(sizes)}) has fewer than dense_below="
            f"{dense_below} elements, so the bucket is sent whole every step (not compressed); "
            f"pass dense_below <= {max(sizes)} to sample its largest tensor",
            UserWarning, stacklevel=2)

    def make_flat(self, opts, flat: torch.Tensor, world: int, bucket_id: int = 0, group=None,
                  shapes=None, per_node: int = 0):
        """The plan for a flat tensor of `world` ranks of `group` (shapes: its tensors, for
        PowerSGD and random-k's dense_below; None = one 1-D tensor); per_node > 0: the two-level
        plan (full precision inside nodes of per_node ranks, this family across them)."""
        dev, idx = _device_of(flat)
        if dist.is_initialized():
            # a wrapper of gloo (the experiments' latency emulation, "gloo_latency") moves
            # bytes as gloo does: the plans choose their routes for gloo
            from ._driver import _gloo
            rank = dist.get_rank(group)
            backend = "gloo" if _gloo(group) else str(dist.get_backend(group))
        else:  # the option probe before any process group
            rank, backend = 0, ""
        return _C.make_plan(self.name, flat.numel(), _dtype_name(flat), world, rank=max(rank, 0),
                            device=dev, device_index=idx, stream=_stream_of(flat),
                            shapes=shapes or [], bucket_id=bucket_id, backend=backend,
                            options=dict(opts), per_node=per_node)

    def begin(self, plan, bucket) -> None:
        """Starts a step: the plan averages the flat bucket in place."""
        self.begin_flat(plan, bucket.buffer())

    @staticmethod
    def begin_flat(plan, flat: torch.Tensor) -> None:
        plan.begin(flat, _stream_of(flat))


class _ProbeBucket:
    """The bucket _Family.validate() builds a plan for: one 8 x 8 fp32 CPU tensor."""

    def __init__(self):
        self._grad = torch.zeros(8, 8)

    def buffer(self):
        return self._grad.view(-1)

    def gradients(self):
        return [self._grad]


# Why some defaults are what they are (the values live in C++: plans/make_plan.cpp):
# - fp16/bf16 route "auto": reduce_scatter (all-to-all of fp16/bf16 chunks, rank-ordered fp32
#   sum, allgather: the same bytes on the wire, but the backend only moves bytes) on gloo, whose
#   half-precision sums are slow on CPU (and which has no bf16 sum in torch 1.13), else one
#   allreduce in the wire type.
# - topk/randomk clip_norm: the global threshold; each of N ranks clips at clip_norm N^-1/2
#   (clip_scaling="sqrt_world", DGC) or at clip_norm itself ("none"). randomk momentum > 0: DGC's
#   momentum correction and masking (use dgc_optimizer: no optimizer momentum); error-feedback
#   random-k under an optimizer with momentum diverges.
# - randomk dense_below 32768: the bucket's tensors of fewer elements (biases, norms, first
#   convolutions, small classifiers) are sent whole every step, with their momentum kept.
#   Sampled at 1%, each of their elements was applied about once in 100 steps with all it
#   gathered, and those bursts made the Fashion-MNIST CNN diverge under momentum 0.9; whole,
#   random-k 1% trained to within about a point of plain DDP
#   (experiments/results/fashion_mnist_randomk_dense_2026-11-25.md). 16384 left the 20480-weight
#   classifier of the 2048-wide variant sampled, and it diverged. A budget of ratio x the bucket
#   instead of a size was tried: DDP's 1 MB first bucket holds that classifier almost alone, so
#   the budget left it sampled (85.39% against 87.28% with it whole).
# - topk exchange "auto": after the first step (which exchanges the payload sizes and so checks
#   that every rank's bucket has the same size) a step skips the size allgather and pads every
#   payload to the largest its k allows, unless the cost model says the padding costs more than
#   the saved round (the padding is up to ~1.6x a delta-coded payload).
# - onebit block_size 128: one scale per server chunk (block_size=0, the 1-bit Adam paper's form)
#   let layers of very different gradient size share a scale and collapsed training;
#   128 costs 0.25 bit per element (25.6x fewer bytes on the wire than a ring allreduce of fp32).
#   scaling "sign_l2" (the block's RMS) drains large gradients from error feedback sooner than
#   the L1 mean and trained better (experiments/results/fashion_mnist_accuracy_2026-11-24.md).
#   momentum > 0: each rank compresses its momentum u = m u + g (use dgc_optimizer). rotate: each
#   block goes through a fixed randomized Hadamard rotation before the sign and back after the
#   average (DRIVE); rotated blocks are near-Gaussian and lose 0.36-0.40 of their energy per phase
#   instead of 0.59-0.69. Same bytes; closed most of the gap to plain DDP on Fashion-MNIST
#   (experiments/results/fashion_mnist_onebit_rotation_2026-11-24.md).
COMPRESSORS = {t["name"]: _Family(t) for t in _C.families()}


# ------------------------------------------------------------------------------------------------
