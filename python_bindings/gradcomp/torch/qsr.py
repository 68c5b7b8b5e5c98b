# SPDX-License-Identifier: Apache-2.0
"""Local SGD / Local AdamW with the Quadratic Synchronization Rule (Gu et al.), and DiLoCo: local
training with an outer optimizer, optionally streamed in fragments.

Each rank trains its own replica with any optimizer and learning-rate scheduler; the replicas are
synchronized every H steps, with H recomputed after each synchronization from the learning rate
at that moment: H = max(H_base, floor((alpha / lr)^2)), capped by the remaining steps, and
H = H_base during the learning-rate warm-up (alpha = 0: the constant period H_base). The schedule
comes from the C++ ``QsrScheduler``, so every rank (holding the same learning rate) synchronizes
at the same steps::

    model = MyNet()                       # not wrapped in DDP: steps are local
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=T)
    avg = QSRAverager(model, opt, alpha=0.0175, h_base=4, total_steps=T, warmup_steps=W)
    for step in range(T):
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        sched.step()                      # first: the averager reads the NEXT step's lr
        avg.step()                        # synchronizes when the rule says so

**Parameter averaging** (``outer=None``): one ``all_reduce`` (sum, then division by N) of all
parameters (and floating buffers, e.g. BatchNorm statistics, with ``average_buffers``) flattened
into one buffer, so all ranks end bitwise identical. With ``compressor`` the replicas exchange
the compressed *change* since the last averaging instead (x = x_sync + average(x - x_sync)).

**An outer step** (``outer="nesterov"``, DiLoCo): every rank keeps the parameters of the last
synchronization (the outer parameters, float32). At a synchronization the pseudo-gradient
x_sync - x (what the inner steps moved) is averaged over the ranks, exactly or through any
gradcomp plan (``compressor``: fp16/bf16, quant 2/4/8, top-k, random-k, 1-bit, PowerSGD; a
lossy plan keeps its error feedback across rounds), and applied by the outer optimizer (SGD with
Nesterov momentum 0.9 and lr 0.7 by default, or ``outer=lambda params: AnyOptimizer(params)``);
every rank then continues from the new outer parameters, bitwise identical on every rank.
Floating buffers are averaged exactly at each synchronization (they are statistics, not
trained).

**Streaming** (Streaming DiLoCo): ``fragments=F`` splits the parameters into F contiguous groups
of about equal size, fragment f synchronized at the steps t = f * H / F (mod H) (with QSR's
period, at S + f * H / F in the round that starts at S and lasts that round's H); ``delay=tau``
runs each fragment's exchange in a background thread while the inner steps go on and merges it
tau steps later: the fragment's outer parameters take the outer step, and the local ones become
``mixing * local + (1 - mixing) * outer`` (mixing defaults to 0.5 with a delay, 0 without:
plain DiLoCo is F = 1, tau = 0). At most one fragment is in flight (tau <= H / F). The last step
synchronizes every fragment at once, so training ends with identical replicas.

Every exchange first gathers a 10-number header from every rank (the round, the step, H, F, the
fragment, its size, the delay, the compressor's options, whether the pseudo-gradient is finite):
ranks that disagree all raise the same ValueError before any payload moves, and a non-finite
pseudo-gradient on any rank skips that fragment's round on every rank (the fragment returns to
its outer parameters; the outer optimizer and error feedback are untouched).
"""
from __future__ import annotations

import concurrent.futures
import copy
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from gradcomp import _C

from ._compat import global_rank
from ._driver import run_sync, wire_bytes
from ._reshard import is_gathered, whole_or_none
from ._families import COMPRESSORS

__all__ = ["QSRAverager", "diloco"]


class _PlanCompressor:
    """Averages a flat tensor in place through a gradcomp plan (state kept across calls)."""

    def __init__(self, name: str, options: Dict[str, Any], group=None):
        if name not in COMPRESSORS:
            raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
        self.name = name
        self.family = COMPRESSORS[name]
        # checked for this rank in the averaging group (1-bit plans check rank < world)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.family.validate(options, world, group if dist.is_initialized() else None)
        self.options = dict(options)
        # one plan per flat buffer (dtype group or fragment): each keeps its own error feedback
        self.plans: Dict[int, Any] = {}

    def plan_for(self, key: int, flat: torch.Tensor, group):
        plan = self.plans.get(key)
        if plan is None or plan.numel != flat.numel():
            # group: the plan's rank is the rank in the averaging group, not the global one
            plan = self.family.make_flat(self.options, flat, dist.get_world_size(group),
                                         bucket_id=key, group=group)
            self.plans[key] = plan
        return plan

    def __call__(self, flat: torch.Tensor, group, key: int = 0):
        """Averages `flat` in place (every plan does: flat holds the average); the run's
        statistics (PlanStats)."""
        plan = self.plan_for(key, flat, group)
        self.family.begin_flat(plan, flat)
        return run_sync(plan, group)


def _options_digest(compressor, options: Dict[str, Any]) -> int:
    """A number that differs between compressor settings (ranks compare it each round)."""
    if compressor is None:
        text = "exact"
    elif isinstance(compressor, _PlanCompressor):
        text = compressor.name + repr(sorted((k, repr(v)) for k, v in options.items()))
    else:
        text = "callable:" + getattr(compressor, "__qualname__", type(compressor).__name__)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


_HEADER = ("magic", "round", "step", "period", "fragments", "fragment", "numel", "delay",
           "options", "finite")
_MAGIC = 0x4C6F436F  # marks an outer-step header


def _flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors in one float32 buffer, in order."""
    return torch.cat([t.detach().reshape(-1).float() for t in ts])


@torch.no_grad()
def _unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of `flat` into the tensors `ts` (cast to their dtypes)."""
    off = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t))
        off += n


def _fragment_bounds(sizes: Sequence[int], parts: int) -> List[Tuple[int, int]]:
    """Splits tensors of `sizes` elements (in model order) into `parts` contiguous, non-empty
    groups of about equal element count: [begin, end) tensor indices."""
    total = sum(sizes)
    bounds, begin, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        left_tensors = len(sizes) - (i + 1)
        left_parts = parts - len(bounds) - 1
        if left_parts == 0:
            continue
        # close this group once it holds its share, or when every later tensor must start one
        if acc * parts >= total * (len(bounds) + 1) or left_tensors == left_parts:
            bounds.append((begin, i + 1))
            begin = i + 1
    bounds.append((begin, len(sizes)))
    return bounds


class _Outer:
    """The outer-step state of a QSRAverager: outer parameters per fragment, the outer optimizer,
    the exchange in flight and the results waiting for their merge step."""

    def __init__(self, params: List[torch.Tensor], fragments: int, make_opt: Callable):
        if fragments > len(params):
            raise ValueError(f"fragments = {fragments} is more than the model's {len(params)} "
                             f"parameter tensors (a fragment is a group of whole tensors)")
        self.params = params
        self.bounds = _fragment_bounds([p.numel() for p in params], fragments)
        with torch.no_grad():
            self.outer = [torch.nn.Parameter(self._flat(f).float().clone())
                          for f in range(fragments)]
        opt = make_opt(self.outer)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"outer must return a torch.optim.Optimizer for the outer "
                             f"parameters, got {type(opt).__name__}")
        self.opt = opt
        self.rounds = [0] * fragments          # exchanges launched per fragment
        self.pending: List[list] = []          # [merge_step, fragment, future or result]
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def tensors(self, f: int) -> List[torch.Tensor]:
        b, e = self.bounds[f]
        return self.params[b:e]

    def _flat(self, f: int) -> torch.Tensor:
        return _flatten(self.tensors(f))

    def numel(self, f: int) -> int:
        return self.outer[f].numel()

    @torch.no_grad()
    def pseudo_gradient(self, f: int) -> torch.Tensor:
        return self.outer[f].detach() - self._flat(f)

    @torch.no_grad()
    def set_local(self, f: int, mixing: float) -> None:
        """The fragment's parameters from its outer parameters: mixing * local + (1 - mixing)
        * outer (mixing 0: the outer parameters exactly)."""
        src = self.outer[f].detach()
        if mixing != 0.0:
            src = self._flat(f) * mixing + src * (1.0 - mixing)
        _unflatten_into(src, self.tensors(f))

    @torch.no_grad()
    def apply(self, f: int, avg_delta: torch.Tensor) -> None:
        """One outer step on fragment f with the averaged pseudo-gradient."""
        for i, o in enumerate(self.outer):
            o.grad = avg_delta.view_as(o) if i == f else None
        with torch.enable_grad():  # some optimizers assert a grad mode; none is recorded
            self.opt.step()
        for o in self.outer:
            o.grad = None


class QSRAverager:
    """Synchronizes Local SGD replicas at the steps the QSR schedules: parameter averaging, or
    an outer optimizer step on the averaged pseudo-gradient (DiLoCo), optionally streamed.

    Args:
        model: the local replica (a plain ``nn.Module``).
        lr: the optimizer whose ``param_groups[0]["lr"]`` is the learning rate, or a callable
            returning the learning rate of the next step.
        alpha: the growth coefficient (>= 0; 0 gives the constant period h_base).
        h_base: the base period (>= 1).
        total_steps: the training length in steps; the last synchronization is at this step.
        warmup_steps: H = h_base while the step count is below this.
        process_group: the group to average over (default: the world). While a delayed exchange
            is in flight (``delay > 0``) a background thread uses it: give the averager a group
            of its own (``dist.new_group()``) if the training loop runs collectives too.
        compressor: None (exact average), a callable ``f(flat, group)`` that averages a flat
            float tensor in place, or a gradcomp compressor name (with ``compressor_options``).
        average_buffers: also average floating-point buffers (e.g. BatchNorm statistics).
        outer: None (parameter averaging), ``"nesterov"`` (SGD with Nesterov momentum
            ``outer_momentum`` and lr ``outer_lr``), or a callable taking the list of outer
            parameters (one float32 tensor per fragment) and returning a torch optimizer.
        outer_lr, outer_momentum: the ``"nesterov"`` outer optimizer's settings.
        fragments: F (outer step only), the number of fragments synchronized in turn.
        delay: tau (outer step only), the inner steps between a fragment's exchange and its
            merge; 0 <= tau <= h_base / F.
        mixing: the local share of a delayed merge, in [0, 1] (default 0.5 with a delay, else
            0; a delay of 0 takes 0 only).

    Streaming (F > 1 or tau > 0) works with either period rule: each round's fragments launch
    at fractions of that round's H (QSR's H never falls below h_base, which bounds F and tau).
    Raises ValueError (from the
    C++ rule) for alpha < 0, h_base < 1, total_steps < 1, warmup_steps < 0 or a learning rate
    <= 0, and for every bad outer-step option, before any collective.
    """

    def __init__(self, model: torch.nn.Module,
                 lr: Union[torch.optim.Optimizer, Callable[[], float]],
                 alpha: float, h_base: int, total_steps: int, warmup_steps: int = 0,
                 process_group=None, compressor: Union[None, str, Callable] = None,
                 compressor_options: Optional[Dict[str, Any]] = None,
                 average_buffers: bool = True, *,
                 outer: Union[None, str, Callable] = None, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, fragments: int = 1, delay: int = 0,
                 mixing: Optional[float] = None):
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
        make_outer = self._check_outer(cfg, outer, outer_lr, outer_momentum, fragments, delay,
                                       mixing)
        self._initial_lr = self._lr()
        self.scheduler = _C.QsrScheduler(cfg, self._initial_lr)
        options = dict(compressor_options or {})
        if isinstance(compressor, str):
            compressor = _PlanCompressor(compressor, options, process_group)
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
        self.sync_steps: List[int] = []  #: the step counts at which the replicas synchronized
        self.periods: List[int] = [self.scheduler.period]  #: H after each averaging (and at 0)
        self.skipped: List[Tuple[int, int]] = []  #: (step, fragment) rounds skipped (not finite)
        self.wire_bytes = 0           #: bytes this rank put on its link for synchronizations
        #: seconds this rank spent in step(): the synchronizations' share of its wall time (what
        #: a delayed exchange did not hide behind the inner steps, and the outer steps)
        self.sync_seconds = 0.0
        self._anchor: Optional[Dict[int, torch.Tensor]] = None
        self._last_sync = (0, self._initial_lr)  # (step, lr) the schedule was last set from
        self._outer: Optional[_Outer] = None
        self.fragments, self.delay = int(fragments), int(delay)
        self.mixing = float(mixing) if mixing is not None else (0.5 if self.delay > 0 else 0.0)
        self._digest = _options_digest(compressor, options)
        if make_outer is not None:
            params = [p for p in model.parameters()]
            if not params:
                raise ValueError("the model has no parameters for an outer step")
            self._outer = _Outer(params, self.fragments, make_outer)
            self._start_identical()

    @staticmethod
    def _check_outer(cfg, outer, outer_lr, outer_momentum, fragments, delay, mixing):
        """Every outer-step option checked before anything is built; the optimizer factory."""
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"delay must be an integer >= 0, got {delay!r}")
        if mixing is not None:
            if (isinstance(mixing, bool) or not isinstance(mixing, (int, float))
                    or not 0.0 <= float(mixing) <= 1.0):
                raise ValueError(f"mixing must be a number in [0, 1], got {mixing!r}")
            if delay == 0 and float(mixing) != 0.0:
                raise ValueError("mixing applies to delayed merges (delay > 0); without a delay "
                                 "the replicas take the outer parameters (mixing 0)")
        if outer is None:
            if fragments != 1 or delay != 0 or mixing is not None:
                raise ValueError("fragments, delay and mixing need an outer step "
                                 "(outer='nesterov' or an optimizer factory)")
            return None
        if fragments > 1 or delay > 0:
            # QSR's periods are never below h_base, so these bounds hold for every round
            if fragments > cfg.h_base:
                raise ValueError(f"fragments = {fragments} is more than h_base = {cfg.h_base} "
                                 f"(one fragment synchronizes per step at most)")
            if delay > cfg.h_base // fragments:
                raise ValueError(f"delay = {delay} is more than h_base / fragments = "
                                 f"{cfg.h_base // fragments}: a fragment's exchange must merge "
                                 f"before the next one starts")
        if outer == "nesterov":
            for name, v, lo_ok in (("outer_lr", outer_lr, False),
                                   ("outer_momentum", outer_momentum, True)):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                    raise ValueError(f"{name} must be a number, got {v!r}")
            if not 0.0 < outer_lr < float("inf"):
                raise ValueError(f"outer_lr must be > 0 and finite, got {outer_lr}")
            if not 0.0 <= outer_momentum < 1.0:
                raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
            lr_, mom = float(outer_lr), float(outer_momentum)
            return lambda ps: torch.optim.SGD(ps, lr=lr_, momentum=mom, nesterov=mom > 0)
        if isinstance(outer, str):
            raise ValueError(f"outer must be None, 'nesterov' or a callable returning an "
                             f"optimizer, got {outer!r}")
        if not callable(outer):
            raise ValueError(f"outer must be None, 'nesterov' or a callable returning an "
                             f"optimizer, got {type(outer).__name__}")
        return outer

    @property
    def next_sync(self) -> int:
        """The step count at which the next (full) synchronization happens."""
        return self.scheduler.next_sync

    @property
    def period(self) -> int:
        return self.scheduler.period

    @property
    def outer_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The outer optimizer (None for parameter averaging)."""
        return self._outer.opt if self._outer is not None else None

    def _world(self) -> int:
        return dist.get_world_size(self.process_group)

    def _buffers(self) -> List[torch.Tensor]:
        if not self.average_buffers:
            return []
        return [b.data for b in self.model.buffers() if b.is_floating_point()]

    def _tensors(self) -> List[torch.Tensor]:
        return [p.data for p in self.model.parameters()] + self._buffers()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Call after each local optimizer step (and after the LR scheduler's step). Returns
        True when a synchronization (of any fragment) started or merged now."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.sync_seconds += time.perf_counter() - t0

    def _step(self) -> bool:
        if self.step_count >= self.scheduler.config.total_steps:
            raise ValueError(f"QSRAverager.step(): all total_steps = "
                             f"{self.scheduler.config.total_steps} steps are done")
        if self._outer is not None and (self.fragments > 1 or self.delay > 0):
            return self._stream_step()
        nxt = self.step_count + 1
        lr = self._lr()
        if lr == 0.0:  # a schedule decayed to 0: H is unbounded, i.e. capped by the end
            lr = 1e-300
        if not self.scheduler.after_step(nxt, lr):
            self.step_count = nxt
            return False
        self.step_count = nxt
        if self._outer is None:
            self.average()
        else:
            self._finish(self._exchange(0, nxt), 0, 0.0)
        self.sync_steps.append(nxt)
        self._last_sync = (nxt, lr)
        if nxt < self.scheduler.config.total_steps:
            self.periods.append(self.scheduler.period)
        return True

    def _stream_step(self) -> bool:
        """Streaming: a round runs from its start S (fragment 0's last synchronization) for the
        schedule's period H (constant, or QSR's from the learning rate at S); fragment f > 0
        launches at S + f H / F, fragment 0 at S + H, each merges tau steps after its launch;
        the last step merges what is in flight and synchronizes every fragment."""
        nxt = self.step_count + 1
        total = self.scheduler.config.total_steps
        start, h = self._last_sync[0], self.scheduler.period  # this round's, before it ends
        lr = max(self._lr(), 1e-300)
        round_ends = self.scheduler.after_step(nxt, lr)  # (its next_sync: fragment 0's rounds)
        if round_ends:
            self._last_sync = (nxt, lr)
        self.step_count = nxt
        out = self._outer
        acted = False
        for entry in [e for e in out.pending if e[0] <= nxt]:
            self._merge(entry, self.mixing)
            acted = True
        if nxt == total:
            for entry in list(out.pending):  # cut short by the end: merged now
                self._merge(entry, self.mixing)
            for f in range(self.fragments):
                self._finish(self._exchange(f, nxt), f, 0.0)
            self.sync_steps.append(nxt)
            return True
        # H >= h_base >= F, so f H / F is past S for f > 0 and short of S + H
        due = ([0] if round_ends else []) + [
            f for f in range(1, self.fragments) if nxt == start + f * h // self.fragments]
        for f in due:
            if self.delay == 0:
                self._finish(self._exchange(f, nxt), f, 0.0)
            else:
                self._launch(f, nxt)
            acted = True
        if round_ends:
            self.sync_steps.append(nxt)
            self.periods.append(self.scheduler.period)
        return acted

    # -- one exchange -----------------------------------------------------------------------------
    def _header(self, f: int, step: int, numel: int, finite: bool) -> torch.Tensor:
        period = self.scheduler.period
        vals = {"magic": _MAGIC, "round": self._outer.rounds[f], "step": step, "period": period,
                "fragments": self.fragments, "fragment": f, "numel": numel, "delay": self.delay,
                "options": self._digest, "finite": int(finite)}
        return torch.tensor([vals[k] for k in _HEADER], dtype=torch.int64)

    def _prepare(self, f: int, step: int):
        """Fragment f's round as it leaves this rank (taken now: with a delay the inner steps go
        on meanwhile): its header, pseudo-gradient and (fragment 0) floating buffers."""
        delta = self._outer.pseudo_gradient(f)
        bufs = self._buffers() if f == 0 else []
        buf_flat = _flatten(bufs) if bufs else None
        finite = bool(torch.isfinite(delta).all()) and (
            buf_flat is None or bool(torch.isfinite(buf_flat).all()))
        header = self._header(f, step, delta.numel(), finite)
        self._outer.rounds[f] += 1
        return f, header, delta, buf_flat

    def _exchange(self, f: int, step: int):
        """Fragment f's round now: ('ok', averaged pseudo-gradient, averaged buffers) or
        ('skip',)."""
        return self._average_round(*self._prepare(f, step))

    def _average_round(self, f: int, header: torch.Tensor, delta: torch.Tensor,
                       buf_flat: Optional[torch.Tensor]):
        group, world = self.process_group, self._world()
        self.wire_bytes += wire_bytes("allgather", 8 * header.numel(), world)
        if not self._check_headers(header):
            return ("skip",)
        if self.compressor is None:
            dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=group)
            delta.div_(world)
            self.wire_bytes += wire_bytes("allreduce", 4 * delta.numel(), world)
        elif isinstance(self.compressor, _PlanCompressor):
            stats = self.compressor(delta, group, key=f)
            self.wire_bytes += stats.wire_bytes
        else:
            self.compressor(delta, group)
        if buf_flat is not None:
            dist.all_reduce(buf_flat, op=dist.ReduceOp.SUM, group=group)
            buf_flat.div_(world)
            self.wire_bytes += wire_bytes("allreduce", 4 * buf_flat.numel(), world)
        return ("ok", delta, buf_flat)

    def _check_headers(self, header: torch.Tensor) -> bool:
        """Gathers every rank's header: a ValueError on every rank alike when they disagree;
        False when some rank's pseudo-gradient is not finite."""
        world = self._world()
        rows = [torch.empty_like(header) for _ in range(world)]
        dist.all_gather(rows, header, group=self.process_group)
        table = torch.stack(rows)
        for i, name in enumerate(_HEADER[:-1]):
            col = table[:, i]
            if not bool((col == col[0]).all()):
                raise ValueError(
                    f"QSRAverager: the ranks disagree on the {name} of an outer step (per rank: "
                    f"{col.tolist()}); every rank needs the same h_base, fragments, delay, "
                    f"compressor options and checkpoint")
        return bool(table[:, -1].all())

    def _launch(self, f: int, step: int) -> None:
        """Starts fragment f's round in the background; merged tau steps later."""
        out = self._outer
        args = self._prepare(f, step)
        if out.pool is None:
            out.pool = concurrent.futures.ThreadPoolExecutor(1, "gradcomp-outer")
        out.pending.append([step + self.delay, f, out.pool.submit(self._average_round, *args)])

    def _merge(self, entry: list, mixing: float) -> None:
        step, f, res = entry
        if isinstance(res, concurrent.futures.Future):
            res = res.result()  # a disagreement raises here, on every rank alike
        self._outer.pending.remove(entry)
        self._finish(res, f, mixing)

    def _finish(self, res, f: int, mixing: float) -> None:
        out = self._outer
        if res[0] == "skip":
            self.skipped.append((self.step_count, f))
            out.set_local(f, 0.0)  # the round is void: back to the last outer parameters
            return
        _, avg_delta, buf_flat = res
        out.apply(f, avg_delta)
        out.set_local(f, mixing)
        if buf_flat is not None:
            _unflatten_into(buf_flat, self._buffers())

    @torch.no_grad()
    def _start_identical(self) -> None:
        """The ranks compare their settings (the header of round -1, so that a rank built with
        other ones raises here, on every rank, instead of pairing unlike collectives), then take
        group rank 0's parameters and floating buffers as the first outer parameters."""
        if not dist.is_initialized():
            raise ValueError("the outer step needs an initialized process group")
        out = self._outer
        sizes = [out.numel(f) for f in range(self.fragments)]
        header = self._header(0, 0, sum(sizes), True)
        header[_HEADER.index("round")] = -1
        self._check_headers(header)
        dests = list(out.outer) + self._buffers()
        flat = _flatten(dests)
        dist.broadcast(flat, src=global_rank(self.process_group, 0), group=self.process_group)
        _unflatten_into(flat, dests)
        for f in range(self.fragments):
            out.set_local(f, 0.0)

    # -- parameter averaging ----------------------------------------------------------------------
    @torch.no_grad()
    def average(self) -> None:
        """Averages the replicas now (one collective; also callable by hand). Parameter
        averaging only: with an outer step, synchronizations follow the schedule."""
        if self._outer is not None:
            raise ValueError("average() is parameter averaging; with an outer step the "
                             "replicas synchronize in step()")
        ts = self._tensors()
        if not ts:
            return
        world = self._world()
        dtypes = {t.dtype for t in ts}
        groups: Dict[torch.dtype, List[torch.Tensor]] = {d: [t for t in ts if t.dtype == d]
                                                         for d in sorted(dtypes, key=str)}
        for i, (dt, group_ts) in enumerate(groups.items()):
            flat = torch.cat([t.reshape(-1) for t in group_ts])
            if self.compressor is None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
                flat.div_(world)
                self.wire_bytes += wire_bytes("allreduce", flat.element_size() * flat.numel(),
                                              world)
            else:
                flat = self._compressed(flat, i)
            _unflatten_into(flat, group_ts)

    def _compressed(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = {}
        anchor = self._anchor.get(i)
        if anchor is None:
            # the first averaging is exact: it gives every rank the same anchor
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            flat.div_(self._world())
            self._anchor[i] = flat.clone()
            return flat
        delta = (flat - anchor).float().contiguous()
        if isinstance(self.compressor, _PlanCompressor):
            self.wire_bytes += self.compressor(delta, self.process_group, key=i).wire_bytes
        else:
            self.compressor(delta, self.process_group)
        new = anchor + delta.to(anchor.dtype)
        self._anchor[i] = new.clone()
        return new

    # -- checkpoints ------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Waits for the exchange in flight (its result stays pending until its merge step)."""
        if self._outer is None:
            return
        for entry in self._outer.pending:
            if isinstance(entry[2], concurrent.futures.Future):
                entry[2] = entry[2].result()

    def state_dict(self) -> Dict[str, Any]:
        """The schedule's position and, with an outer step, everything a restart on as many
        ranks needs to continue bitwise: the outer parameters and optimizer, the rounds, the
        results waiting for their merge, and each fragment plan's error feedback. Waits for an
        exchange in flight."""
        sd: Dict[str, Any] = {"version": 1, "step_count": self.step_count,
                              "sync_steps": list(self.sync_steps), "periods": list(self.periods),
                              "next_sync": self.next_sync, "last_sync": list(self._last_sync),
                              "skipped": [list(s) for s in self.skipped],
                              "wire_bytes": self.wire_bytes}
        if self._outer is None:
            return sd
        self._drain()
        out = self._outer
        world = self._world()
        plans = None
        if isinstance(self.compressor, _PlanCompressor):
            plans = {f: p.state_dict() for f, p in self.compressor.plans.items()}
        sd["outer"] = {
            "world_size": world, "fragments": self.fragments, "delay": self.delay,
            "mixing": self.mixing, "options": self._digest,
            "numel": [out.numel(f) for f in range(self.fragments)],
            "params": [o.detach().clone() for o in out.outer],
            "optimizer": copy.deepcopy(out.opt.state_dict()),
            "rounds": list(out.rounds),
            "pending": [[s, f, [r[0]] + [None if t is None else t.clone() for t in r[1:]]]
                        for s, f, r in out.pending],
            "plans": plans,
            # this rank's replica: the construction took group rank 0's parameters (as DDP
            # does), so a restart mid-round gets its own back from here
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
        }
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: one rank's, on as many ranks, or a gathered checkpoint
        (``gradcomp.torch.gather_state_dict(averager)``: every rank's) on any number of ranks.
        Everything is checked first; a bad checkpoint is refused whole with a ValueError and
        nothing changes (a gathered one by every rank alike). A rank that loads another round
        than its peers gets a ValueError at the next exchange, on every rank.

        On another number of ranks (outer step only), each new rank takes the parts every rank
        shares (outer parameters and optimizer, rounds, results waiting for their merge), the
        element-wise mean of the old replicas (so the round's average pseudo-gradient is what it
        was) and each fragment plan's error feedback resharded as the hooks' is
        (``gradcomp._C.reshard_state``: its sum over ranks divided by the world size kept)."""
        gathered = is_gathered(sd)
        if gathered and self._outer is None:
            raise ValueError("a gathered checkpoint is for the outer step's per-rank state; a "
                             "parameter-averaging QSRAverager's state_dict() is the same on "
                             "every rank: load it as it is")
        apply = whole_or_none(gathered, self.process_group,
                              lambda: self._check_state(self._own_state(sd) if gathered else sd))
        apply()

    def _own_state(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's state from a gathered checkpoint (resharded for another world size)."""
        world, rank = self._world(), dist.get_rank(self.process_group)
        ranks, P = sd.get("ranks"), sd.get("world_size")
        if (isinstance(P, bool) or not isinstance(P, int) or P < 1
                or not isinstance(ranks, list) or len(ranks) != P
                or not all(isinstance(s, dict) and isinstance(s.get("outer"), dict)
                           for s in ranks)):
            raise ValueError("gathered checkpoint: needs 'world_size' P and 'ranks', P outer-step "
                             "states")
        if world == P:
            return ranks[rank]
        base = ranks[0]
        for r, s in enumerate(ranks[1:], 1):  # one job's checkpoint of one step
            for k in ("step_count", "sync_steps", "last_sync", "next_sync"):
                if s.get(k) != base.get(k):
                    raise ValueError(f"gathered checkpoint: rank {r} has {k} = {s.get(k)!r}, "
                                     f"rank 0 {base.get(k)!r}: not one job's checkpoint of one "
                                     f"step")
            o, b = s["outer"], base["outer"]
            for k in ("world_size", "fragments", "delay", "mixing", "options", "numel",
                      "rounds"):
                if o.get(k) != b.get(k):
                    raise ValueError(f"gathered checkpoint: rank {r}'s outer {k} = "
                                     f"{o.get(k)!r}, rank 0's {b.get(k)!r}")
            if not _same_tensors(o.get("params"), b.get("params")) or not _same_tensors(
                    o.get("pending"), b.get("pending")):
                raise ValueError(f"gathered checkpoint: rank {r}'s outer parameters or pending "
                                 f"results differ from rank 0's (every rank holds the same)")
        models = [s["outer"].get("model") for s in ranks]
        if not all(isinstance(m, dict) and set(m) == set(models[0]) for m in models):
            raise ValueError("gathered checkpoint: the ranks' replicas have different entries")
        local = {}
        for k, v in models[0].items():
            vs = [m[k] for m in models]
            if (not all(isinstance(x, torch.Tensor) and x.shape == v.shape
                        and x.dtype == v.dtype for x in vs)):
                raise ValueError(f"gathered checkpoint: replica entry {k!r} differs in shape or "
                                 f"type between ranks")
            local[k] = (torch.stack([x.double() for x in vs]).mean(0).to(v.dtype)
                        if v.is_floating_point() else v.clone())
        plans = base["outer"].get("plans")
        if isinstance(plans, dict):
            new = {}
            for f in plans:
                states = [s["outer"].get("plans", {}).get(f) for s in ranks]
                if not all(isinstance(x, (bytes, bytearray)) for x in states):
                    raise ValueError(f"gathered checkpoint: fragment {f!r}'s plan state must be "
                                     f"bytes on every rank")
                try:
                    new[f] = _C.reshard_state([bytes(x) for x in states], world, rank)
                except ValueError as e:
                    raise ValueError(f"gathered checkpoint: fragment {f!r}: {e}") from None
            plans = new
        return dict(base, outer=dict(base["outer"], world_size=world, model=local, plans=plans))

    def _check_state(self, sd: Dict[str, Any]) -> Callable[[], None]:
        """Everything load_state_dict() checks, nothing applied; returns what applies it."""
        if not isinstance(sd, dict):
            raise ValueError(f"state_dict must be a dict, got {type(sd).__name__}")
        need = ("version", "step_count", "sync_steps", "periods", "last_sync")
        missing = [k for k in need if k not in sd]
        if missing:
            raise ValueError(f"state_dict lacks {missing}")
        if sd["version"] != 1:
            raise ValueError(f"state_dict version {sd['version']!r} is not 1")
        total = self.scheduler.config.total_steps
        step = sd["step_count"]
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= total:
            raise ValueError(f"state_dict['step_count'] must be in [0, {total}], got {step!r}")
        last = sd["last_sync"]
        if (not isinstance(last, (list, tuple)) or len(last) != 2
                or not isinstance(last[0], int) or not 0 <= last[0] <= step):
            raise ValueError(f"state_dict['last_sync'] must be [step <= step_count, lr], "
                             f"got {last!r}")
        sched = _C.QsrScheduler(self.scheduler.config, self._initial_lr)
        if 0 < last[0] < total:
            try:
                sched.on_average(int(last[0]), float(last[1]))
            except (ValueError, TypeError) as e:
                raise ValueError(f"state_dict['last_sync']: {e}") from None
        elif last[0] == total:
            sched = None  # training is done: no step() is accepted
        if sched is not None and "next_sync" in sd and sched.next_sync != sd["next_sync"]:
            raise ValueError(f"state_dict['next_sync'] = {sd['next_sync']} does not follow from "
                             f"its last synchronization (step {last[0]}, lr {last[1]}) with this "
                             f"averager's settings (next_sync {sched.next_sync}): alpha, h_base "
                             f"or warmup_steps differ")
        applied = self._check_outer_state(sd) if self._outer is not None else None
        if self._outer is None and "outer" in sd:
            raise ValueError("state_dict holds an outer step; this averager averages parameters")

        def apply() -> None:  # everything checked
            if sched is not None:
                self.scheduler = sched
            self.step_count = step
            self.sync_steps = list(sd["sync_steps"])
            self.periods = list(sd["periods"])
            self._last_sync = (int(last[0]), float(last[1]))
            self.skipped = [tuple(s) for s in sd.get("skipped", [])]
            self.wire_bytes = int(sd.get("wire_bytes", 0))
            if applied is not None:
                applied()
        return apply

    def _check_outer_state(self, sd: Dict[str, Any]) -> Callable[[], None]:
        """Checks the outer part of a checkpoint; returns what applies it."""
        o = sd.get("outer")
        if not isinstance(o, dict):
            raise ValueError("state_dict has no outer-step state (saved by a parameter-averaging "
                             "QSRAverager?)")
        out = self._outer
        world = self._world()
        for key, mine in (("world_size", world), ("fragments", self.fragments),
                          ("delay", self.delay), ("mixing", self.mixing),
                          ("options", self._digest),
                          ("numel", [out.numel(f) for f in range(self.fragments)])):
            if o.get(key) != mine:
                raise ValueError(f"state_dict['outer']['{key}'] = {o.get(key)!r}, this averager "
                                 f"has {mine!r} (a checkpoint loads into the same settings on "
                                 f"as many ranks)")
        params = o.get("params")
        if (not isinstance(params, list) or len(params) != self.fragments
                or any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                       or t.numel() != out.numel(f) for f, t in enumerate(params))):
            raise ValueError("state_dict['outer']['params'] must be one float32 tensor of each "
                             "fragment's size")
        if any(not bool(torch.isfinite(t).all()) for t in params):
            raise ValueError("state_dict['outer']['params'] holds a non-finite value")
        rounds = o.get("rounds")
        if (not isinstance(rounds, list) or len(rounds) != self.fragments
                or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rounds)):
            raise ValueError(f"state_dict['outer']['rounds'] must be {self.fragments} counts")
        pending = o.get("pending")
        if not isinstance(pending, list):
            raise ValueError("state_dict['outer']['pending'] must be a list")
        for p in pending:
            ok = (isinstance(p, list) and len(p) == 3 and isinstance(p[0], int)
                  and sd["step_count"] < p[0] <= sd["step_count"] + self.delay
                  and isinstance(p[1], int) and 0 <= p[1] < self.fragments
                  and isinstance(p[2], list) and p[2][:1] in (["ok"], ["skip"]))
            if ok and p[2][0] == "ok":
                nbuf = sum(b.numel() for b in self._buffers()) if p[1] == 0 else 0
                ok = (len(p[2]) == 3 and isinstance(p[2][1], torch.Tensor)
                      and p[2][1].dtype == torch.float32 and p[2][1].numel() == out.numel(p[1])
                      and (p[2][2] is None if nbuf == 0 else
                           isinstance(p[2][2], torch.Tensor) and p[2][2].numel() == nbuf))
            if not ok:
                raise ValueError(f"state_dict['outer']['pending'] entry {p!r:.120} is not "
                                 f"[merge step in (step_count, step_count + delay], fragment, "
                                 f"result]")
        local = o.get("model")
        mine = self.model.state_dict()
        if (not isinstance(local, dict) or set(local) != set(mine)
                or any(not isinstance(local[k], torch.Tensor) or local[k].shape != v.shape
                       or local[k].dtype != v.dtype for k, v in mine.items())):
            raise ValueError("state_dict['outer']['model'] does not match the model's "
                             "state_dict (names, shapes, dtypes)")
        # the optimizer and plans: loaded into copies first, so a refusal changes nothing
        opt_copy = copy.deepcopy(out.opt)
        try:
            opt_copy.load_state_dict(copy.deepcopy(o.get("optimizer")))
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
            raise ValueError(f"state_dict['outer']['optimizer']: {e}") from None
        plans = o.get("plans")
        fresh = None
        if isinstance(self.compressor, _PlanCompressor):
            if not isinstance(plans, dict):
                raise ValueError("state_dict['outer']['plans'] must hold the compressor's state")
            fresh = _PlanCompressor.__new__(_PlanCompressor)
            fresh.__dict__.update(self.compressor.__dict__, plans={})
            for f, st in plans.items():
                if not isinstance(f, int) or not 0 <= f < self.fragments:
                    raise ValueError(f"state_dict['outer']['plans'] has a bad fragment {f!r}")
                probe = torch.zeros(out.numel(f))
                plan = fresh.plan_for(f, probe, self.process_group)
                try:
                    plan.load_state_dict(st)
                except (ValueError, TypeError, KeyError) as e:
                    raise ValueError(f"state_dict['outer']['plans'][{f}]: {e}") from None
        elif plans is not None:
            raise ValueError("state_dict['outer']['plans'] holds compressor state; this averager "
                             "has no gradcomp compressor")

        def apply() -> None:
            self._drain()
            self.model.load_state_dict(local)
            with torch.no_grad():
                for t, src in zip(out.outer, params):
                    t.copy_(src)
            out.opt.load_state_dict(opt_copy.state_dict())
            # the optimizer's state must refer to this averager's outer parameters
            out.rounds = list(rounds)
            out.pending = [[s, f, [r[0]] + [None if t is None else t.clone() for t in r[1:]]]
                           for s, f, r in pending]
            if fresh is not None:
                self.compressor.plans = fresh.plans
        return apply


def _same_tensors(a, b) -> bool:
    """a and b hold the same structure of lists and values, tensors equal to the bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
                and len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b)))
    return a == b


def diloco(model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, h: int,
           total_steps: int, **kwargs) -> QSRAverager:
    """DiLoCo with a constant period: ``QSRAverager(model, inner_optimizer, alpha=0, h_base=h,
    total_steps=total_steps, outer="nesterov", **kwargs)`` (outer lr 0.7, Nesterov momentum
    0.9; pass ``compressor=``, ``fragments=``, ``delay=`` for compressed and streamed outer
    steps)."""
    kwargs.setdefault("outer", "nesterov")
    return QSRAverager(model, inner_optimizer, alpha=0.0, h_base=h, total_steps=total_steps,
                       **kwargs)
