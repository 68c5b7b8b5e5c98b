# SPDX-License-Identifier: Apache-2.0
"""Local SGD / Local AdamW with the Quadratic Synchronization Rule (Gu et al.).

Each rank trains its own replica with any optimizer and learning-rate scheduler; the replicas'
parameters are averaged every H steps, with H recomputed after each averaging from the learning
rate at that moment: H = max(H_base, floor((alpha / lr)^2)), capped by the remaining steps, and
H = H_base during the learning-rate warm-up. The schedule comes from the C++
``QsrScheduler``, so every rank (holding the same learning rate) averages at the same steps::

    model = MyNet()                       # not wrapped in DDP: steps are local
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=T)
    avg = QSRAverager(model, opt, alpha=0.0175, h_base=4, total_steps=T, warmup_steps=W)
    for step in range(T):
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        sched.step()                      # first: the averager reads the NEXT step's lr
        avg.step()                        # averages when the rule says so

Averaging is one ``all_reduce`` (sum, then division by N) of all parameters (and floating
buffers, e.g. BatchNorm statistics, with ``average_buffers``) flattened into one buffer, so all
ranks end bitwise identical. With ``compressor`` the replicas exchange the compressed *change*
since the last averaging instead (x = x_sync + average(x - x_sync)), which is safe for lossy
compressors with error feedback: ``compressor`` is a callable ``f(flat, group)`` averaging the
float tensor ``flat`` in place, or the name of a gradcomp compressor (``"topk"``, ...), with
``compressor_options``, run through gradcomp's compressed-allreduce plans.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from gradcomp import _C

from ._driver import run_sync
from ._families import COMPRESSORS

__all__ = ["QSRAverager"]


class _PlanCompressor:
    """Averages a flat tensor in place through a gradcomp plan (state kept across calls)."""

    def __init__(self, name: str, options: Dict[str, Any], group=None):
        if name not in COMPRESSORS:
            raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
        self.family = COMPRESSORS[name]
        # checked for this rank in the averaging group (1-bit plans check rank < world)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.family.validate(options, world, group if dist.is_initialized() else None)
        self.options = dict(options)
        self.plan = None
        self.numel = -1

    def __call__(self, flat: torch.Tensor, group) -> None:
        if self.plan is None or self.numel != flat.numel():
            # group: the plan's rank is the rank in the averaging group, not the global one
            self.plan = self.family.make_flat(self.options, flat, dist.get_world_size(group),
                                              group=group)
            self.numel = flat.numel()
        self.family.begin_flat(self.plan, flat)
        run_sync(self.plan, group)  # every plan averages in place: flat holds the average


class QSRAverager:
    """Averages the parameters of a Local SGD replica at the steps the QSR schedules.

    Args:
        model: the local replica (a plain ``nn.Module``).
        lr: the optimizer whose ``param_groups[0]["lr"]`` is the learning rate, or a callable
            returning the learning rate of the next step.
        alpha: the growth coefficient (>= 0; 0 gives the constant period h_base).
        h_base: the base period (>= 1).
        total_steps: the training length in steps; the last averaging is at this step.
        warmup_steps: H = h_base while the step count is below this.
        process_group: the group to average over (default: the world).
        compressor: None (exact average), a callable ``f(flat, group)`` that averages a flat
            float tensor in place, or a gradcomp compressor name (with ``compressor_options``).
        average_buffers: also average floating-point buffers (e.g. BatchNorm statistics).

    Raises ValueError (from the C++ rule) for alpha < 0, h_base < 1, total_steps < 1,
    warmup_steps < 0 or a learning rate <= 0.
    """

    def __init__(self, model: torch.nn.Module,
                 lr: Union[torch.optim.Optimizer, Callable[[], float]],
                 alpha: float, h_base: int, total_steps: int, warmup_steps: int = 0,
                 process_group=None, compressor: Union[None, str, Callable] = None,
                 compressor_options: Optional[Dict[str, Any]] = None,
                 average_buffers: bool = True):
        if isinstance(lr, torch.optim.Optimizer):
            opt = lr
            self._lr = lambda: float(opt.param_groups[0]["lr"])
        elif callable(lr):
            self._lr = lambda: float(lr())
        else:
            raise ValueError(f"lr must be an optimizer or a callable returning the learning "
                             f"rate, got {type(lr).__name__}")
        cfg = _C.QsrConfig(alpha=float(alpha), h_base=int(h_base), total_steps=int(total_steps),
                           warmup_steps=int(warmup_steps))
        self.scheduler = _C.QsrScheduler(cfg, self._lr())
        if isinstance(compressor, str):
            compressor = _PlanCompressor(compressor, compressor_options or {}, process_group)
        elif compressor is not None and not callable(compressor):
            raise ValueError("compressor must be None, a callable f(flat, group) or a gradcomp "
                             f"compressor name, got {type(compressor).__name__}")
        elif compressor_options:
            raise ValueError("compressor_options apply to a named gradcomp compressor only")
        self.model = model
        self.process_group = process_group
        self.compressor = compressor
        self.average_buffers = bool(average_buffers)
        self.step_count = 0           #: local steps done
        self.sync_steps: List[int] = []  #: the step counts at which parameters were averaged
        self.periods: List[int] = [self.scheduler.period]  #: H after each averaging (and at 0)
        self._anchor: Optional[Dict[int, torch.Tensor]] = None

    @property
    def next_sync(self) -> int:
        """The step count at which the next averaging happens."""
        return self.scheduler.next_sync

    @property
    def period(self) -> int:
        return self.scheduler.period

    def _tensors(self) -> List[torch.Tensor]:
        ts = [p.data for p in self.model.parameters()]
        if self.average_buffers:
            ts += [b.data for b in self.model.buffers() if b.is_floating_point()]
        return ts

    def step(self) -> bool:
        """Call after each local optimizer step (and after the LR scheduler's step). Returns
        True when the parameters were averaged now."""
        if self.step_count >= self.scheduler.config.total_steps:
            raise ValueError(f"QSRAverager.step(): all total_steps = "
                             f"{self.scheduler.config.total_steps} steps are done")
        nxt = self.step_count + 1
        lr = self._lr()
        if lr == 0.0:  # a schedule decayed to 0: H is unbounded, i.e. capped by the end
            lr = 1e-300
        if not self.scheduler.after_step(nxt, lr):
            self.step_count = nxt
            return False
        self.step_count = nxt
        self.average()
        self.sync_steps.append(nxt)
        if nxt < self.scheduler.config.total_steps:
            self.periods.append(self.scheduler.period)
        return True

    @torch.no_grad()
    def average(self) -> None:
        """Averages the replicas now (one collective; also callable by hand)."""
        ts = self._tensors()
        if not ts:
            return
        world = dist.get_world_size(self.process_group)
        dtypes = {t.dtype for t in ts}
        groups: Dict[torch.dtype, List[torch.Tensor]] = {d: [t for t in ts if t.dtype == d]
                                                         for d in sorted(dtypes, key=str)}
        for i, (dt, group_ts) in enumerate(groups.items()):
            flat = torch.cat([t.reshape(-1) for t in group_ts])
            if self.compressor is None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
                flat.div_(world)
            else:
                flat = self._compressed(flat, i)
            off = 0
            for t in group_ts:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n

    def _compressed(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = {}
        anchor = self._anchor.get(i)
        if anchor is None:
            # the first averaging is exact: it gives every rank the same anchor
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            flat.div_(dist.get_world_size(self.process_group))
            self._anchor[i] = flat.clone()
            return flat
        delta = (flat - anchor).float().contiguous()
        self.compressor(delta, self.process_group)
        new = anchor + delta.to(anchor.dtype)
        self._anchor[i] = new.clone()
        return new

    def state_dict(self) -> Dict[str, Any]:
        return {"step_count": self.step_count, "sync_steps": list(self.sync_steps),
                "periods": list(self.periods), "next_sync": self.next_sync}
