# SPDX-License-Identifier: Apache-2.0
"""PyTorch DDP communication hooks backed by gradcomp's compressed allreduce plans.

One line in a DDP script::

    state, hook = gradcomp.torch.hook("topk", ratio=0.001)
    ddp_model.register_comm_hook(state, hook)

Compressors: ``"auto"`` (measures the others on the real model and link, then picks per bucket),
``"allreduce"`` (plain, through our driver), ``"fp16"`` / ``"bf16"`` (cast),
``"topk"`` (Deep Gradient Compression: residual, momentum correction, clipping, warm-up),
``"randomk"`` (the same state as top-k, shared random indices; the bucket's tensors of fewer
than ``dense_below`` elements, default 32768, are sent whole), ``"onebit"`` (two-phase
compressed allreduce with worker and server error), ``"quant"`` (2/4/8-bit blocks, the same two
phases) and ``"powersgd"``. The hooks run gradcomp plans over any torch.distributed process
group (gloo on CPU, NCCL on GPU) asynchronously: a hook returns a ``torch.futures.Future`` at
once, and a worker thread with a process group of its own issues every bucket's collectives in
bucket order.

Bucket state. DDP rebuilds its buckets once, after the first iteration. Like PyTorch's PowerSGD
hook, a gradcomp hook runs a plain allreduce for the first ``start_iter`` iterations (default 2 for
the stateful compressors) and creates per-bucket state (residuals, momenta, Q, errors) at the
first compressed step. The state follows the parameters, not the bucket index: a job whose
buckets DDP groups differently (a restart, another ``bucket_cap_mb``) runs each saved bucket's
plan on its own parameters (``model=`` keys them by their index in the model). A bucket that
holds part of a saved bucket's parameters is an error (a silent re-initialisation would drop
error-feedback memory).

Sharded training (FSDP2): :func:`compress_fsdp` (``gradcomp.torch.fsdp``) gives every
``fully_shard`` module a compressed reduce-scatter and, optionally, allgather.

Momentum. With ``momentum > 0`` the top-k and random-k hooks apply DGC's momentum correction
themselves (random-k keeps the momentum of the tensors it sends whole); the optimizer must then
not apply momentum again: use ``torch.optim.SGD(..., momentum=0)`` (see
:func:`dgc_optimizer`).
"""
from ._auto import AutoState  # noqa: F401
from ._driver import run_sync  # noqa: F401
from ._entry import hook  # noqa: F401
from ._families import COMPRESSORS  # noqa: F401
from ._hook import BucketTransform, GradcompState, dgc_optimizer  # noqa: F401
from ._reshard import gather_state_dict  # noqa: F401
from ._stats import format_timeline, timeline  # noqa: F401
from .dropcompute import CudaEventClock, DropCompute  # noqa: F401
from .fsdp import FSDPCompression, compress_fsdp  # noqa: F401
from .onebit_adam import OneBitAdam  # noqa: F401
from .qsr import QSRAverager, diloco  # noqa: F401

__all__ = ["hook", "GradcompState", "BucketTransform", "AutoState", "dgc_optimizer", "timeline", "format_timeline",
           "gather_state_dict", "COMPRESSORS", "DropCompute", "CudaEventClock", "QSRAverager",
           "diloco", "OneBitAdam", "compress_fsdp", "FSDPCompression"]
