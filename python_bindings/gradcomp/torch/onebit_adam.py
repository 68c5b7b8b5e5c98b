# SPDX-License-Identifier: Apache-2.0
"""1-bit Adam (Tang et al., 2021) as an optimizer and DDP hook pair, the hook running the
compressed exchange during backward.

Error-compensated 1-bit compression cannot carry Adam's second moment (it is not linear in the
gradient), so 1-bit Adam trains with full-precision AdamW for ``freeze_step`` steps, then freezes
the second moment v and exchanges only the first moment, compressed::

    opt = gradcomp.torch.OneBitAdam(model.parameters(), lr=1e-3, weight_decay=0.05,
                                    freeze_step=500)
    state, h = gradcomp.torch.hook("onebit", adam=opt)   # momentum and start_iter from opt
    ddp_model.register_comm_hook(state, h)

- Steps 1 .. freeze_step: the hook averages the gradients in full precision (its ``start_iter``)
  and ``step()`` is AdamW (decoupled weight decay, bias-corrected moments).
- Then: the hook divides each gradient by the frozen denominator d = sqrt(v / (1 - beta2^T0))
  + eps (T0 = freeze_step), and its 1-bit plan keeps each rank's momentum u = beta1 u + g / d
  (from 0 at the freeze), compresses u plus its worker error, averages with the server error
  (the two-phase 1-bit allreduce) and hands the average of u to the optimizer as the gradient.
  ``step()`` moves by lr (beta1^k m_T0 / d + (1 - beta1) u) / (1 - beta1^t), k = t - T0 the
  steps since the freeze: Adam's bias-corrected m_t / d, its momentum carried on from the
  warm-up as in the paper. The carried part needs no exchange: m_T0 is the same on every rank
  (the warm-up averaged in full precision). Averaging u is averaging the new part of m / d:
  with d fixed both are the same linear recursion of the gradients. (Restarting the momentum at
  the freeze instead, lr (1 - beta1) u / (1 - beta1^k), cost accuracy right after the freeze:
  experiments/results/2026-11-27-fashion-mnist-vit-adamw/NOTES.md.) Compressing m / d rather than m keeps the compression error
  of a coordinate in proportion to its own step: the error of a block's sign-and-scale is of the
  size of the block's typical entry, and divided by a small sqrt(v) afterwards (as in the
  paper's form) it moved coordinates with small gradients by up to the block's scale over their
  own, which diverged in the tests here within two steps of the freeze.

The exchange runs inside DDP's hook, bucket by bucket while backward continues; DeepSpeed's
1-bit Adam runs it in ``optimizer.step()``, after backward (``hook("onebit", adam=opt,
overlap=False)`` reproduces that structure, same result, to measure the difference). The paper's payload (one sign per
element, one scale per server chunk) is the hook's ``block_size=0``; the default 128-element
blocks add 0.25 bit per element and trained better here.

A step the hook skips (a non-finite gradient: a loss scaler's overflow step) is not counted by
the hook, and ``GradScaler`` then skips ``step()``: v, the momentum and the errors stay as they
were (tested with torch.amp.GradScaler and fp16 autocast, and with one rank's Inf loss). The
optimizer's state (moments, step) is in ``opt.state_dict()``, the hook's (momentum,
errors, iteration) in ``state.state_dict()``; save and restore both.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """AdamW for ``freeze_step`` steps, then Adam with the second moment frozen and the first
    moment taken from the ``hook("onebit", adam=...)`` that averages it (module docstring).

    Args: ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled, as AdamW) as in
    ``torch.optim.AdamW``; ``freeze_step`` (>= 1): the full-precision steps before the variance
    freezes; ``var_floor``: a coordinate's frozen second moment is taken as at least this
    fraction of its tensor's mean (see inverse_denominator). Every parameter group must share
    ``betas`` and ``freeze_step`` (the hook has one momentum and one start for all buckets)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, freeze_step: int = 100,
                 var_floor: float = 0.01):
        def real(x):  # a real number (not a bool, a string or a tensor), else None
            return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None

        if real(lr) is None or not (lr > 0.0 and math.isfinite(lr)):
            raise ValueError(f"OneBitAdam: lr must be a positive number, got {lr!r}")
        for name, x in (("eps", eps), ("weight_decay", weight_decay), ("var_floor", var_floor)):
            if real(x) is None:
                raise ValueError(f"OneBitAdam: {name} must be a number, got {x!r}")
        try:
            b1, b2 = (real(b) for b in betas)
        except (TypeError, ValueError):
            raise ValueError(f"OneBitAdam: betas must be a pair (beta1, beta2), got {betas!r}") \
                from None
        if b1 is None or b2 is None or not (0.0 < b1 < 1.0 and 0.0 < b2 < 1.0):
            raise ValueError(f"OneBitAdam: betas must lie in (0, 1), got {betas}")
        if not (eps > 0.0):
            raise ValueError(f"OneBitAdam: eps must be positive, got {eps}")
        if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
            raise ValueError(f"OneBitAdam: weight_decay must be >= 0, got {weight_decay}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"OneBitAdam: freeze_step must be an integer >= 1, got "
                             f"{freeze_step!r}")
        if not (0.0 <= var_floor <= 1.0):
            raise ValueError(f"OneBitAdam: var_floor must lie in [0, 1], got {var_floor}")
        super().__init__(params, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay,
                                      freeze_step=freeze_step, var_floor=float(var_floor)))
        for g in self.param_groups:
            if tuple(g["betas"]) != (b1, b2) or g["freeze_step"] != freeze_step:
                raise ValueError("OneBitAdam: every parameter group must share betas and "
                                 "freeze_step (the hook has one momentum and one start)")

    @property
    def beta1(self) -> float:
        return float(self.param_groups[0]["betas"][0])

    @property
    def freeze_step(self) -> int:
        return int(self.param_groups[0]["freeze_step"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd, t0 = group["lr"], group["eps"], group["weight_decay"], group["freeze_step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("OneBitAdam does not take sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                g = p.grad
                if t <= t0:  # full precision: AdamW
                    m.mul_(b1).add_(g, alpha=1.0 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    denom = (v / (1.0 - b2 ** t)).sqrt_().add_(eps)
                    p.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))
                else:  # g: the hook's averaged momentum u of g / d (module docstring)
                    # m_t / d = beta1^k m_T0 / d + (1 - beta1) u_k: Adam's momentum carried on
                    # from the warm-up (m_T0 stays in exp_avg; it is the same on every rank, the
                    # warm-up averaged in full precision), v frozen
                    k = t - t0
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    corr = -lr / (1.0 - b1 ** t)
                    carried = b1 ** k
                    if carried > 1e-30:  # (0.9^k: below it after 650 steps)
                        p.addcmul_(m, self.inverse_denominator(p), value=corr * carried)
                    p.add_(g, alpha=corr * (1.0 - b1))
        return loss

    def check_step(self, hook_iter: int) -> None:
        """(BucketTransform.check_step: hook(adam=opt) makes the optimizer the hook's bucket
        transform.) The hook and its optimizer must be at the same step: the hook sends the frozen,
        preconditioned momentum from freeze_step on, and the optimizer applies it as such only from
        its own freeze_step on. A model and hook state from after the freeze loaded beside an
        optimizer state from before it (or the other way) would have the optimizer take the
        preconditioned momentum for a gradient (seen: the loss at 5e8 five steps later). Each step
        compares the optimizer's step count (the largest over its parameters: one that had no
        gradient in some step, unused in that forward, counts fewer) with the hook's iteration; a
        mismatch is a ValueError naming both. (Before the optimizer's first step there is nothing to
        compare.)"""
        steps = [int(st["step"]) for st in self.state.values() if st and "step" in st]
        if steps and max(steps) != hook_iter:
            raise ValueError(
                f"1-bit Adam: the hook is at step {hook_iter} and the optimizer at step "
                f"{max(steps)} (freeze_step {self.freeze_step}): their states come from "
                f"different points of training (load the model, the optimizer and the hook "
                f"from the same checkpoint)")

    def before_compress(self, bucket) -> None:
        """Divides the bucket's gradients by the optimizer's frozen denominators, in place (the hook
        calls it on compressed steps, before its plan reads the bucket: BucketTransform)."""
        with torch.no_grad():
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                g.mul_(self.inverse_denominator(p))

    def inverse_denominator(self, p: torch.Tensor) -> torch.Tensor:
        """1 / d for parameter p: what the hook divides p's gradient by after the freeze, with
        d = sqrt(max(v_hat, var_floor * mean(v_hat))) + eps and v_hat = v / (1 - beta2^T0) the
        frozen, bias-corrected second moment. The floor: a frozen v cannot grow when a
        coordinate whose gradient was (near) zero in the warm-up (a unit ReLU kept dead, say)
        starts moving, and at v = 0 Adam's step would be g / eps; with the floor such a
        coordinate steps at most 1 / sqrt(var_floor) times its tensor's typical step (10x by
        default), and it does not touch coordinates within that range. A parameter whose v is
        all zero (no gradient in the whole warm-up) gets 0: it then moves only by weight decay.
        Computed once (a load_state_dict() clears it)."""
        cache = self.__dict__.setdefault("_inv_d", {})
        key = id(p)
        if key not in cache:
            st = self.state.get(p)
            if not st:
                cache[key] = torch.zeros_like(p)
            else:
                g = next(gr for gr in self.param_groups if any(q is p for q in gr["params"]))
                b2, eps, t0 = g["betas"][1], g["eps"], g["freeze_step"]
                vh = st["exp_avg_sq"] / (1.0 - b2 ** t0)
                mean = float(vh.mean()) if vh.numel() else 0.0
                if mean > 0.0:
                    d = vh.clamp_(min=g["var_floor"] * mean).sqrt_().add_(eps)
                    cache[key] = d.reciprocal_()
                else:
                    cache[key] = torch.zeros_like(p)
        return cache[key]

    def load_state_dict(self, state_dict):
        self.__dict__.pop("_inv_d", None)
        super().load_state_dict(state_dict)


def hook_options(adam: Any, start_iter: Optional[int], options: Dict[str, Any]) -> int:
    """What ``hook("onebit", adam=opt)`` adds: the hook's momentum is beta1 and its start_iter
    freeze_step; a conflicting momentum or start_iter given beside ``adam`` is a ValueError.
    Returns the start_iter (options gains 'momentum')."""
    if not isinstance(adam, OneBitAdam):
        raise ValueError(f"hook(adam=...) takes a gradcomp.torch.OneBitAdam, got "
                         f"{type(adam).__name__}")
    b1, t0 = adam.beta1, adam.freeze_step
    if "momentum" in options and float(options["momentum"]) != b1:
        raise ValueError(f"hook(adam=...): momentum={options['momentum']} differs from the "
                         f"optimizer's beta1 = {b1}; leave momentum out")
    if start_iter is not None and int(start_iter) != t0:
        raise ValueError(f"hook(adam=...): start_iter={start_iter} differs from the optimizer's "
                         f"freeze_step = {t0}; leave start_iter out")
    options["momentum"] = b1
    return t0
