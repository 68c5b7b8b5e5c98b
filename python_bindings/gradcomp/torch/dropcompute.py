# SPDX-License-Identifier: Apache-2.0
"""DropCompute around a DDP gradient-accumulation loop (Giladi et al.).

Each rank accumulates up to M micro-batches per step. Once the time since the step started passes
the threshold tau, the rank stops computing micro-batches and joins the gradient allreduce with
what it has: synchronous training stays intact, only the batch size becomes random::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(*gradcomp.torch.hook("topk", ratio=0.01))   # optional: any DDP hook
    dc = DropCompute(ddp, micro_batches=12)                            # tau found automatically
    for step in range(steps):
        opt.zero_grad()
        for x, y in dc.microbatches(loader_iter):
            loss_fn(ddp(x), y).backward()     # the plain mean loss of the micro-batch
        opt.step()                            # grads: averaged, normalised (see below)

Exactly one gradient allreduce per step. All micro-batches but the last run under DDP's
``no_sync()``; the M-th runs with synchronisation, so DDP (and its comm hook) overlaps the
allreduce with that backward as usual. When the threshold stops a rank early, the last backward
it ran did not synchronise; the helper then runs a *sync pass*: a backward of a zero-valued
function of every parameter, which adds exact zeros to the accumulated gradients and fires DDP's
reducer (and so the registered comm hook) on them. The allreduce is then not overlapped with
compute, which is the price of stopping early. The sync pass uses DDP's reducer
(``prepare_for_backward``), as DDP's own forward does; DDP's ``static_graph`` mode is not
supported. Every rank computes at least one micro-batch per step.

Drop points (``drop_point``): ``"before_forward"`` (default: an unstarted micro-batch is
skipped, nothing computed is wasted), ``"after_backward"`` (the check follows each backward), and
``"between_forward_backward"`` (the backward of the current micro-batch is skipped, its forward is
wasted; the loop body must call ``dc.backward(loss)`` instead of ``loss.backward()``; every
micro-batch then runs under ``no_sync()`` and the step ends with the sync pass).

Gradient normalisation (``normalization``); backward the plain per-micro-batch mean loss (do
not divide by M yourself), DDP averages over the N ranks, and the helper then rescales:

* ``"nominal"`` divides the summed micro-batch gradients by N*M (the reference implementation).
  No extra communication. Bias: E[g] = (E[M~]/M) * the full-batch gradient, i.e. the gradient
  (and the effective learning rate) shrinks by the completion rate.
* ``"actual"`` divides by the number of micro-batches computed on all ranks (one tiny allreduce
  of the count after the gradient allreduce). The result is exactly the mean of the computed
  micro-batch gradients: no shrinkage, but a ratio estimator (unbiased only conditionally on the
  counts). Both options share the selection bias that slow micro-batches (long sequences) are
  dropped more often.

Automatic tau (``tau=None``): the first ``warmup_steps`` steps run without a threshold and record
each micro-batch's latency (and the step's wall time); then one ``all_gather`` brings every
rank's latencies to every rank, and each rank computes ``find_optimal_tau`` on the same bytes,
so all ranks get the bitwise same tau. The serial time Tc (allreduce, optimizer, ...) is the
measured step wall time minus the slowest rank's compute time, unless ``serial_time`` is given.
With ``reestimate_every=K`` a new measurement window starts every K steps after an estimate.
Measurement steps defer the allreduce to a sync pass so the latencies exclude communication.

Timers: ``timer="cpu"`` a monotonic clock (C++ steady_clock); ``"cuda"`` CUDA events synchronised
at the check points (``sync_on_earlier=True`` waits only for the previous check point's event, so
the host never drains the queue it just filled; the time read is then one check point late);
``"auto"`` picks by the device of the model's parameters; or any callable returning seconds.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradcomp import dropcompute as _dc

__all__ = ["DropCompute", "CudaEventClock"]

_INF = float("inf")


class CudaEventClock:
    """Seconds of device time on the current CUDA stream, read through CUDA events.

    Each call records an event and waits for it (or, with ``sync_on_earlier``, for the event of
    the previous call) and returns the time from the origin event to the one waited for.
    :meth:`reset` (called at each step start by :class:`DropCompute`) records a new origin, so
    the float32 milliseconds of ``cudaEventElapsedTime`` stay precise in long runs.
    """

    def __init__(self, device: Optional[Union[int, str, torch.device]] = None,
                 sync_on_earlier: bool = False):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaEventClock needs CUDA (torch.cuda.is_available() is False)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self.sync_on_earlier = bool(sync_on_earlier)
        self._origin: Optional[torch.cuda.Event] = None
        self._prev: Optional[torch.cuda.Event] = None

    def _record(self) -> "torch.cuda.Event":
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def reset(self) -> None:
        self._origin = self._record()
        self._prev = None

    def __call__(self) -> float:
        if self._origin is None:
            self.reset()
        e = self._record()
        target = self._prev if (self.sync_on_earlier and self._prev is not None) else e
        self._prev = e
        target.synchronize()
        return self._origin.elapsed_time(target) / 1e3


def _collective_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DropCompute:
    """The DropCompute helper (see the module docstring).

    Args:
        model: a ``DistributedDataParallel`` model (a plain module is accepted in a single
            process, or when torch.distributed is not initialised).
        micro_batches: M >= 1, micro-batches per step.
        tau: the compute threshold in seconds (> 0), or None to find it automatically.
        drop_point: ``"before_forward"``, ``"between_forward_backward"`` or ``"after_backward"``.
        normalization: ``"nominal"`` (divide by N*M) or ``"actual"`` (by the computed count).
        warmup_steps: steps measured before the automatic tau (>= 1 when tau is None).
        reestimate_every: 0, or start a new measurement window K steps after each estimate.
        serial_time: Tc in seconds for the tau search, or None to measure it.
        process_group: the group of the allreduce (default: DDP's, else the world).
        timer: ``"auto"``, ``"cpu"``, ``"cuda"`` or a callable returning seconds.
        sync_on_earlier: with the CUDA timer, wait only for the previous check point's event.
        stop_model: the StopModel of the tau search (default: the one matching drop_point).

    Raises ValueError for M < 1, tau <= 0 or NaN, an unknown drop point or normalisation, a
    negative or NaN serial time, a non-DDP model in a multi-rank job, or DDP's static_graph.
    """

    def __init__(self, model: torch.nn.Module, micro_batches: int, tau: Optional[float] = None,
                 drop_point: str = "before_forward", normalization: str = "nominal",
                 warmup_steps: int = 5, reestimate_every: int = 0,
                 serial_time: Optional[float] = None, process_group=None,
                 timer: Union[str, Callable[[], float]] = "auto", sync_on_earlier: bool = False,
                 stop_model: Optional[str] = None):
        # -- validation: everything before any state is created --------------------------------
        if isinstance(micro_batches, bool) or int(micro_batches) != micro_batches \
                or micro_batches < 1:
            raise ValueError(f"micro_batches M must be an integer >= 1, got {micro_batches}")
        if tau is not None:
            tau = float(tau)
            if not tau > 0.0:  # also NaN
                raise ValueError(f"tau must be > 0 seconds (or None: automatic), got {tau}")
        if drop_point not in _dc.DROP_POINTS:
            raise ValueError(f"unknown drop_point {drop_point!r}; expected one of "
                             f"{_dc.DROP_POINTS}")
        if normalization not in _dc.NORMALIZATIONS:
            raise ValueError(f"unknown normalization {normalization!r}; expected one of "
                             f"{_dc.NORMALIZATIONS}")
        if int(warmup_steps) != warmup_steps or warmup_steps < (1 if tau is None else 0):
            raise ValueError(f"warmup_steps must be an integer >= {1 if tau is None else 0} "
                             f"(the automatic tau needs measured steps), got {warmup_steps}")
        if int(reestimate_every) != reestimate_every or reestimate_every < 0:
            raise ValueError(f"reestimate_every must be an integer >= 0, got {reestimate_every}")
        if serial_time is not None and not (math.isfinite(float(serial_time))
                                            and float(serial_time) >= 0.0):
            raise ValueError(f"serial_time must be finite and >= 0 seconds (or None: measured), "
                             f"got {serial_time}")
        if stop_model is not None and stop_model not in ("preemptive", "boundary"):
            raise ValueError(f"unknown stop_model {stop_model!r}; expected preemptive or boundary")
        ddp = model if isinstance(model, DistributedDataParallel) else None
        distributed = dist.is_available() and dist.is_initialized()
        if ddp is None and distributed and dist.get_world_size(process_group) > 1:
            raise ValueError("DropCompute in a multi-rank job needs a DistributedDataParallel "
                             f"model (got {type(model).__name__}): DDP's no_sync() and its "
                             "reducer make the single allreduce per step")
        if ddp is not None and getattr(ddp, "static_graph", False):
            raise ValueError("DropCompute does not support DDP(static_graph=True): the number of "
                             "backward passes per step varies")
        if timer not in ("auto", "cpu", "cuda") and not callable(timer):
            raise ValueError(f"timer must be 'auto', 'cpu', 'cuda' or a callable, got {timer!r}")

        self.model = model
        self.ddp = ddp
        self.micro_batches = int(micro_batches)
        self.drop_point = drop_point
        self.normalization = normalization
        self.warmup_steps = int(warmup_steps)
        self.reestimate_every = int(reestimate_every)
        self.serial_time = None if serial_time is None else float(serial_time)
        self.stop_model = stop_model or _dc.stop_model_for(drop_point)
        if process_group is None and ddp is not None:
            process_group = getattr(ddp, "process_group", None)
        self.process_group = process_group
        self._distributed = distributed and ddp is not None
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1

        params = [p for p in model.parameters() if p.requires_grad]
        if timer == "auto":
            timer = "cuda" if params and params[0].is_cuda else "cpu"
        self._cuda_clock: Optional[CudaEventClock] = None
        if timer == "cuda":
            self._cuda_clock = CudaEventClock(params[0].device if params else None,
                                              sync_on_earlier)
            clock = self._cuda_clock
        elif timer == "cpu":
            clock = None
        else:
            clock = timer
        self.timer = timer if isinstance(timer, str) else "callable"

        auto = tau is None
        self.tau: float = _INF if auto else tau
        M = self.micro_batches
        # Two controllers: the measuring one records latencies (a clock read per micro-batch),
        # the running one reads the clock only at the configured check point.
        self._ctl_run = _dc.ThresholdController(M, tau=self.tau, drop_point=drop_point,
                                                clock=clock)
        hist = max(1, self.warmup_steps)
        self._ctl_measure = _dc.ThresholdController(M, drop_point=drop_point,
                                                    history_steps=hist, clock=clock)
        self._measure_left = self.warmup_steps if auto else 0
        self._next_window_at = -1 if auto or self.reestimate_every == 0 else self.reestimate_every
        self._window: List[list] = []  # [latency row or None, wall seconds or None]
        self._prev_begin: Optional[float] = None
        self._prev_measured = False

        # public state
        self.step = 0                    #: steps completed
        self.estimates: List[Dict[str, Any]] = []  #: one dict per automatic tau estimate
        self.last: Dict[str, Any] = {}   #: the last step's record
        self.micro_batches_done = 0      #: this rank's micro-batches computed, all steps
        self.micro_batches_nominal = 0   #: steps * M
        self.sync_passes = 0             #: steps that ended with the sync pass
        self.exhausted = False           #: the data iterator ran out
        self.skipped_measurements = 0    #: measured steps dropped: non-finite gradients

        # per-step scratch
        self._in_step = False
        self._m = -1
        self._bw_state: Optional[bool] = None
        self._cur = self._ctl_run

    # -- public helpers ---------------------------------------------------------------------------
    @property
    def drop_rate(self) -> float:
        """This rank's fraction of micro-batches not computed, over all steps so far."""
        if self.micro_batches_nominal == 0:
            return 0.0
        return 1.0 - self.micro_batches_done / self.micro_batches_nominal

    @property
    def measuring(self) -> bool:
        """Whether the current (or next) step is a measurement step without threshold."""
        return self._measure_left > 0

    def backward(self, loss: torch.Tensor, **kwargs) -> bool:
        """``loss.backward()`` unless the threshold stops the step here (drop point
        ``between_forward_backward``; at the other points it always runs the backward).
        Returns whether the backward ran."""
        if not self._in_step:
            raise RuntimeError("DropCompute.backward() is for the body of "
                               "`for mb in dc.microbatches(...)`")
        if (self.drop_point == "between_forward_backward" and self._m > 0
                and not self._cur.proceed("between_forward_backward")):
            self._bw_state = False
            return False
        loss.backward(**kwargs)
        self._bw_state = True
        return True

    def state_dict(self) -> Dict[str, Any]:
        return {"tau": self.tau, "step": self.step, "estimates": list(self.estimates),
                "measure_left": self._measure_left, "next_window_at": self._next_window_at}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        tau = float(sd["tau"])
        if not tau > 0.0:
            raise ValueError(f"state_dict: tau must be > 0, got {tau}")
        self._ctl_run.set_tau(tau)
        self.tau = tau
        self.step = int(sd["step"])
        self.estimates = list(sd.get("estimates", []))
        self._measure_left = int(sd.get("measure_left", 0))
        self._next_window_at = int(sd.get("next_window_at", -1))
        self._window = []
        self._prev_begin = None
        self._prev_measured = False

    # -- the loop ---------------------------------------------------------------------------------
    def microbatches(self, data: Iterable) -> Iterator[Any]:
        """Yields up to M micro-batches from ``data`` (an iterator: what is not consumed stays in
        it) for one step; the body runs forward and backward. After the loop the gradients are
        synchronised (one allreduce) and normalised. Do not ``break`` out of the loop."""
        if self._in_step:
            raise RuntimeError("DropCompute.microbatches(): the previous step's loop is still open")
        it = iter(data)
        self._begin_step()
        ctl = self._cur
        measuring = ctl is self._ctl_measure
        M = self.micro_batches
        dp = self.drop_point
        defer = self.ddp is None or measuring or dp == "between_forward_backward"
        if self._cuda_clock is not None:
            self._cuda_clock.reset()
        ctl.begin_step()
        self._prev_begin = time.perf_counter()
        self._prev_measured = measuring
        self._in_step = True
        synced = False
        ran_any = False
        try:
            for m in range(M):
                if m > 0 and dp == "before_forward" and not ctl.proceed("before_forward"):
                    break
                try:
                    mb = next(it)
                except StopIteration:
                    self.exhausted = True
                    break
                last = (m == M - 1) and not defer
                self._m = m
                self._bw_state = None
                if self.ddp is not None and not last:
                    with self.ddp.no_sync():
                        yield mb
                else:
                    yield mb
                if self._bw_state is None and dp == "between_forward_backward":
                    raise RuntimeError("with drop_point='between_forward_backward' the loop body "
                                       "must call dc.backward(loss) instead of loss.backward()")
                if self._bw_state is False:  # backward skipped by the threshold
                    break
                ctl.micro_batch_done()
                ran_any = True
                synced = last
                if dp == "after_backward" and not ctl.proceed("after_backward"):
                    break
        except BaseException:
            if ctl.in_step:
                ctl.end_step()
            self._in_step = False
            self._prev_begin = None
            raise
        rec = ctl.end_step()
        self._in_step = False
        if not ran_any and self.exhausted:
            # no data at all: nothing to synchronise (other ranks must run out at the same step)
            self.last = {"completed": 0, "dropped": True, "elapsed": rec.elapsed, "exhausted": True}
            self._prev_begin = None
            return
        if self.ddp is not None and not synced:
            self._sync_pass()
            self.sync_passes += 1
        total = self._total_completed(rec.completed)
        scale = self._scale(total)
        if scale != 1.0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads:
                if hasattr(torch, "_foreach_mul_"):
                    torch._foreach_mul_(grads, scale)
                else:  # pragma: no cover
                    for g in grads:
                        g.mul_(scale)
        # bookkeeping
        if measuring and not self._grads_finite():
            # an overflow step (a loss scaler skips it): its latencies are not kept, and the
            # window waits for one more measured step, so that tau comes out as in a run
            # without this step (the scan costs a read of the gradients, in measured steps only)
            self._prev_measured = False
            self.skipped_measurements += 1
        elif measuring:
            row = None
            if rec.completed == M:
                row = np.array(ctl.history[-1], dtype=np.float64)
            self._window.append([row, None])
            self._measure_left -= 1
        self.step += 1
        self.micro_batches_done += rec.completed
        self.micro_batches_nominal += M
        self.last = {"step": self.step - 1, "completed": rec.completed, "dropped": rec.dropped,
                     "elapsed": rec.elapsed, "tau": ctl.tau, "measuring": measuring,
                     "total_completed": total, "scale": scale, "sync_pass": not synced}

    # -- internals --------------------------------------------------------------------------------
    def _grads_finite(self) -> bool:
        """Whether every averaged gradient is finite (one host sync for all of them)."""
        flags = [torch.isfinite(p.grad).all() for p in self.model.parameters()
                 if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True

    def _begin_step(self) -> None:
        """Closes the wall time of the previous measured step, runs a pending tau estimate (a
        collective, at the same step on every rank) and picks this step's controller."""
        if self._prev_measured and self._prev_begin is not None and self._window:
            if self._cuda_clock is not None:
                torch.cuda.synchronize(self._cuda_clock.device)
            self._window[-1][1] = time.perf_counter() - self._prev_begin
        self._prev_measured = False
        if self._measure_left == 0 and self._window:
            self._estimate()
        if 0 <= self._next_window_at <= self.step and self._measure_left == 0:
            self._measure_left = max(1, self.warmup_steps)
            self._next_window_at = -1
        self._cur = self._ctl_measure if self._measure_left > 0 else self._ctl_run

    def _estimate(self) -> None:
        M = self.micro_batches
        K = len(self._window)
        W = M + 2
        buf = torch.zeros(K * W, dtype=torch.float64)
        for s, (row, wall) in enumerate(self._window):
            ok = row is not None and wall is not None
            if ok:
                buf[s * W: s * W + M] = torch.from_numpy(row)
                buf[s * W + M] = wall
                buf[s * W + M + 1] = 1.0
        self._window = []
        N = self.world_size
        if self._distributed and N > 1:
            dev = _collective_device(self.process_group)
            send = buf.to(dev)
            outs = [torch.empty_like(send) for _ in range(N)]
            dist.all_gather(outs, send, group=self.process_group)
            arr = np.stack([o.cpu().numpy() for o in outs]).reshape(N, K, W)
        else:
            arr = buf.numpy().reshape(1, K, W)
        valid = np.all(arr[:, :, M + 1] > 0.0, axis=0)
        S = int(valid.sum())
        record: Dict[str, Any] = {"step": self.step, "steps_used": S}
        if S == 0:
            record["tau"] = self.tau
            record["note"] = "no step complete on every rank; tau unchanged"
        else:
            lat = np.ascontiguousarray(arr[:, valid, :M])
            walls = np.ascontiguousarray(arr[:, valid, M])
            trace = _dc.LatencyTrace(N, S, M, lat)
            tc = self.serial_time if self.serial_time is not None \
                else _dc.serial_time_from_walls(trace, walls)
            best = _dc.estimate_tau(trace, tc, self.stop_model)
            self.tau = best.tau
            self._ctl_run.set_tau(best.tau)
            record.update(best.as_dict())
            record["serial_time"] = tc
            st = _dc.latency_stats(trace)
            record["latency_mean"] = st.mean
            record["latency_stddev"] = st.stddev
        self.estimates.append(record)
        if self.reestimate_every > 0:
            self._next_window_at = self.step + self.reestimate_every

    def _sync_pass(self) -> None:
        """A backward that adds exact zeros to every parameter's gradient with DDP's reducer
        armed, so the accumulated gradients go through the allreduce (and the comm hook)."""
        ddp = self.ddp
        ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        params = [p for n, p in ddp.module.named_parameters()
                  if p.requires_grad and n not in ignore]
        if not params:
            return
        reducer = ddp.reducer
        if hasattr(reducer, "prepare_for_forward"):
            reducer.prepare_for_forward()
        with torch.enable_grad():
            terms = [p.reshape(-1)[:1].sum().float() for p in params]
            dummy = torch.stack(terms).sum() * 0.0
        if getattr(ddp, "find_unused_parameters", False):
            reducer.prepare_for_backward([dummy])
        else:
            reducer.prepare_for_backward([])
        # as after a synchronising forward: the next forward broadcasts buffers
        ddp.require_forward_param_sync = True
        dummy.backward()

    def _total_completed(self, completed: int) -> Optional[int]:
        if self.normalization != "actual":
            return None
        if not (self._distributed and self.world_size > 1):
            return int(completed)
        t = torch.tensor([int(completed)], dtype=torch.int64,
                         device=_collective_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return int(t.item())

    def _scale(self, total: Optional[int]) -> float:
        """The factor for DDP's averaged gradient (the sum over ranks divided by N)."""
        N, M = self.world_size, self.micro_batches
        if self.normalization == "nominal":
            return N * _dc.gradient_scale("nominal", N, M, 0)
        return N * _dc.gradient_scale("actual", N, M, int(total))
