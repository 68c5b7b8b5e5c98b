# SPDX-License-Identifier: Apache-2.0
"""DropCompute and QSR without torch: analytics, latency traces, the tau* search, the simulator.

The DropCompute paper (Giladi et al.) bounds each worker's compute time per step by a threshold
tau: once the time since the step started passes tau, the worker stops computing micro-batches
and joins the gradient allreduce with what it has. Everything here is the C++ core
(``gradcomp/straggler.hpp``) plus a few NumPy conveniences; the PyTorch helper around the
accumulation loop is :class:`gradcomp.torch.dropcompute.DropCompute`, the Local SGD averager is
:class:`gradcomp.torch.qsr.QSRAverager`.

Example (the tau* of a gathered trace, the same on every rank)::

    from gradcomp import dropcompute as dc
    trace = dc.trace_from_histories([h0, h1, h2, h3])   # each (steps, M) seconds
    best = dc.find_optimal_tau(trace, serial_time=0.05, stop_model="boundary")
    print(best.tau, best.speedup, best.drop_rate)

Analytics (paper Section 4): :func:`expected_max_normal` (Eq. 4),
:func:`expected_completed_microbatches` (Eq. 5), :func:`effective_speedup` (Eq. 6),
:func:`compensation_factor` (R = M / M~ - 1), :func:`analytic_point`, :func:`analytic_optimal_tau`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from gradcomp._C import (  # noqa: F401
    EULER_GAMMA,
    AnalyticModel,
    AnalyticPoint,
    DelayModel,
    LatencyStats,
    LatencyTrace,
    QsrConfig,
    QsrScheduler,
    ScalePoint,
    StepRecord,
    TauCurvePoint,
    TauEval,
    ThresholdController,
    analytic_optimal_tau,
    analytic_point,
    compensation_factor,
    effective_speedup,
    evaluate_tau,
    expected_completed_microbatches,
    expected_max_normal,
    find_optimal_tau,
    gradient_scale,
    latency_moments,
    latency_stats,
    monotonic_seconds,
    normal_cdf,
    normal_quantile,
    qsr_period,
    scale_curve,
    simulate_latencies,
    tau_curve,
)

__all__ = [
    "EULER_GAMMA", "AnalyticModel", "AnalyticPoint", "DelayModel", "LatencyStats", "LatencyTrace",
    "QsrConfig", "QsrScheduler", "ScalePoint", "StepRecord", "TauCurvePoint", "TauEval",
    "ThresholdController", "analytic_optimal_tau", "analytic_point", "compensation_factor",
    "effective_speedup", "evaluate_tau", "expected_completed_microbatches", "expected_max_normal",
    "find_optimal_tau", "gradient_scale", "latency_moments", "latency_stats", "monotonic_seconds",
    "normal_cdf", "normal_quantile", "qsr_period", "scale_curve", "simulate_latencies",
    "tau_curve", "trace_from_histories", "serial_time_from_walls", "estimate_tau",
    "DROP_POINTS", "NORMALIZATIONS", "stop_model_for",
]

DROP_POINTS = ("before_forward", "between_forward_backward", "after_backward")
NORMALIZATIONS = ("nominal", "actual")


def stop_model_for(drop_point: str) -> str:
    """The StopModel of the tau* search that matches a check point: a check before the forward or
    after the backward finishes the micro-batch during which tau passes ('boundary'); a check
    between forward and backward is closer to the paper's preemptive model."""
    if drop_point not in DROP_POINTS:
        raise ValueError(f"unknown drop point {drop_point!r}; expected one of {DROP_POINTS}")
    return "preemptive" if drop_point == "between_forward_backward" else "boundary"


def trace_from_histories(histories: Sequence[np.ndarray]) -> LatencyTrace:
    """A LatencyTrace from the per-rank (steps, M) latency histories, in rank order.

    Raises ValueError for no ranks, different shapes, or a negative/NaN/Inf latency.
    """
    if len(histories) == 0:
        raise ValueError("trace_from_histories: no latency histories (expected one per rank)")
    arrs = [np.asarray(h, dtype=np.float64) for h in histories]
    shape = arrs[0].shape
    if len(shape) != 2:
        raise ValueError(f"trace_from_histories: each history must be (steps, M), got {shape}")
    for r, a in enumerate(arrs):
        if a.shape != shape:
            raise ValueError(f"trace_from_histories: rank {r} has shape {a.shape}, rank 0 {shape}")
    data = np.ascontiguousarray(np.stack(arrs))
    return LatencyTrace(len(arrs), shape[0], shape[1], data)


def serial_time_from_walls(trace: LatencyTrace, walls: np.ndarray) -> float:
    """Tc per step, estimated as mean over steps of (mean over workers of the step's wall time -
    max over workers of its compute time), clamped at 0. ``walls`` is (workers, steps).

    Plain sequential float arithmetic in a fixed order: bitwise the same on every rank for the
    same inputs (no NumPy reductions, whose order can depend on SIMD paths)."""
    w = np.asarray(walls, dtype=np.float64)
    if w.shape != (trace.workers, trace.steps):
        raise ValueError(f"serial_time_from_walls: walls must be (workers, steps) = "
                         f"({trace.workers}, {trace.steps}), got {w.shape}")
    lat = trace.latency.tolist()
    wl = w.tolist()
    total = 0.0
    for s in range(trace.steps):
        wall = 0.0
        tmax = 0.0
        for n in range(trace.workers):
            if not math.isfinite(wl[n][s]) or wl[n][s] < 0:
                raise ValueError(f"serial_time_from_walls: wall time [{n}, {s}] = {wl[n][s]}")
            wall += wl[n][s]
            c = 0.0
            for x in lat[n][s]:
                c += x
            tmax = max(tmax, c)
        total += wall / trace.workers - tmax
    return max(0.0, total / trace.steps)


def estimate_tau(trace: LatencyTrace, serial_time: float, stop_model: str = "boundary") -> TauEval:
    """find_optimal_tau with a validated serial time (ValueError for NaN or negative)."""
    if not (isinstance(serial_time, (int, float)) and math.isfinite(serial_time)
            and serial_time >= 0):
        raise ValueError(f"serial_time must be a finite number >= 0 (seconds), got {serial_time}")
    return find_optimal_tau(trace, serial_time=float(serial_time), stop_model=stop_model)

