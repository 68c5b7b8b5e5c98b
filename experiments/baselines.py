# SPDX-License-Identifier: Apache-2.0
"""PyTorch's own DDP communication hooks as baselines for gradcomp's (the DDP hook benchmark and
the Fashion-MNIST experiment), and the bytes they hand to allreduce per step."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

#: PowerSGD settings shared by PyTorch's hook and ours in every comparison: compression from the
#: second step (PyTorch's default start_powerSGD_iter=1000 would run plain allreduce that long)
PSGD = dict(start_iter=2, min_compression_rate=2.0, use_error_feedback=True, warm_start=True)

KINDS = ("torch-fp16", "torch-powersgd", "torch-allreduce", "no-comm", "sync-floor")


def _torch_psgd_waited(state, bucket):
    """torch's powerSGD_hook, waited for inside the hook. Unwaited, on torch 1.13 + gloo it
    aborted (gloo "op.preamble.length <= op.nbytes") or hung from about 1M parameters on 4
    ranks: it issues its P and Q allreduces from completion callbacks on gloo's threads. With
    the model in one bucket the bucket is ready only at the end of backward, where DDP waits for
    the future anyway, so waiting here costs no overlap; with several buckets it serialises
    them (the outputs that use it say so)."""
    fut = ps.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _no_comm(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sync_floor(state, bucket):
    """One 1-element allreduce per bucket, then the bucket untouched: what synchronising the
    ranks once per bucket costs (the floor of any synchronous compressor: with ranks sharing
    cores, every step then waits for the slowest rank's backward)."""
    flag = torch.zeros(1, dtype=bucket.buffer().dtype)
    buf = bucket.buffer()
    return torch.distributed.all_reduce(flag, async_op=True).get_future().then(lambda _: buf)


def register(kind: str, model, opts: Optional[Dict[str, Any]] = None) -> None:
    """Registers PyTorch's hook `kind` on the DDP `model`: "torch-fp16" (fp16_compress_hook),
    "torch-allreduce" (allreduce_hook: DDP's own average, as a hook),
    "torch-powersgd" (powerSGD_hook, waited; opts["rank"], PSGD settings), "no-comm" (returns
    each bucket untouched: the compute floor, no communication) or "sync-floor" (each bucket
    untouched after a 1-element allreduce: the compute floor with one synchronisation per
    bucket)."""
    opts = opts or {}
    if kind == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch-allreduce":  # DDP's average as a hook: what any comm hook starts from
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "no-comm":
        model.register_comm_hook(None, _no_comm)
    elif kind == "sync-floor":
        model.register_comm_hook(None, _sync_floor)
    elif kind == "torch-powersgd":
        st = ps.PowerSGDState(process_group=None, matrix_approximation_rank=int(opts["rank"]),
                              start_powerSGD_iter=PSGD["start_iter"],
                              min_compression_rate=PSGD["min_compression_rate"],
                              use_error_feedback=PSGD["use_error_feedback"],
                              warm_start=PSGD["warm_start"], random_seed=0)
        model.register_comm_hook(st, _torch_psgd_waited)
    else:
        raise ValueError(f"unknown PyTorch baseline {kind!r}; known: {', '.join(KINDS)}")


def torch_psgd_bytes(model: torch.nn.Module, r: int, min_rate: float) -> int:
    """Bytes powerSGD_hook hands to allreduce per step (torch 1.13's compression rule)."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += p.numel() * 4
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        if n * m > (n + m) * r * min_rate:
            total += (n + m) * r * 4
        else:
            total += n * m * 4
    return total


def bytes_per_step(kind: str, model: torch.nn.Module, opts: Optional[Dict[str, Any]] = None) -> int:
    """Bytes handed to allreduce per step by plain DDP ("ddp") or a PyTorch baseline (all of
    them ring allreduces; fp32 parameters)."""
    n = sum(p.numel() for p in model.parameters())
    if kind in ("no-comm", "sync-floor"):
        return 0  # sync-floor: 4 bytes per bucket, not counted
    if kind in ("ddp", "torch-allreduce"):
        return 4 * n
    if kind == "torch-fp16":
        return 2 * n
    if kind == "torch-powersgd":
        return torch_psgd_bytes(model, int((opts or {})["rank"]), PSGD["min_compression_rate"])
    raise ValueError(f"unknown baseline {kind!r}")
