# SPDX-License-Identifier: Apache-2.0
"""DropCompute through the bindings: analytics against independent NumPy references, the tau*
search on known traces, the controller, the normalisation factor, the simulator, bad input."""
import math
import struct

import numpy as np
import pytest

import gradcomp
from gradcomp import dropcompute as dc


# -- independent references -----------------------------------------------------------------------
def phi(x):
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def phi_inv(p):
    lo, hi = -40.0, 40.0
    for _ in range(200):  # bisection on math.erf: independent of the library's quantile
        mid = 0.5 * (lo + hi)
        if phi(mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def exact_expected_max(n):
    """E[max of n iid N(0, 1)] = int x n phi(x) Phi(x)^(n-1) dx (trapezoid on a fine grid)."""
    x = np.linspace(-12.0, 12.0, 48001)
    cdf = np.array([phi(v) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    f = x * n * pdf * cdf ** (n - 1)
    return float(np.sum((f[1:] + f[:-1]) * 0.5 * np.diff(x)))


def bits(x):
    return struct.pack("<d", x)


def test_import_gradcomp_does_not_need_torch_for_dropcompute():
    import sys
    import subprocess
    code = ("import sys; sys.modules['torch'] = None; import gradcomp, gradcomp.dropcompute as d; "
            "print(d.qsr_period(0.001, 0.0175, 4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "306"


# -- analytics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("x", [-5.0, -1.3, 0.0, 0.4, 2.0, 7.5])
def test_normal_cdf_and_quantile(x):
    assert dc.normal_cdf(x) == pytest.approx(phi(x), rel=1e-12, abs=1e-300)
    p = phi(x)
    if 1e-12 < p < 1 - 1e-12:
        assert dc.normal_quantile(p) == pytest.approx(x, abs=1e-7)


@pytest.mark.parametrize("n", [2, 16, 64, 200, 1024])
def test_expected_max_normal_against_numerical_integration(n):
    exact = exact_expected_max(n)
    got = dc.expected_max_normal(n)
    # Eq. 4 itself, from an independent quantile
    g = dc.EULER_GAMMA
    eq4 = (1 - g) * phi_inv(1 - 1 / n) + g * phi_inv(1 - 1 / (math.e * n))
    assert got == pytest.approx(eq4, rel=1e-9)
    if n >= 16:
        assert abs(got - exact) / exact < 0.02, (n, got, exact)
    else:
        assert exact == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # E[max of 2]
        assert abs(got - exact) / exact < 0.10
    # affine in (mu, sigma)
    assert dc.expected_max_normal(n, 3.0, 0.5) == pytest.approx(3.0 + 0.5 * got, rel=1e-12)
    assert dc.expected_max_normal(1, 3.0, 0.5) == 3.0


@pytest.mark.parametrize("tau,m,mu,sigma", [(12.0, 12, 1.0, 0.1), (9.5, 12, 1.0, 0.3),
                                            (3.0, 1, 2.0, 1.0), (30.0, 7, 4.0, 2.0)])
def test_expected_completed_against_monte_carlo(tau, m, mu, sigma):
    rng = np.random.default_rng(1234)
    samples = rng.normal(mu, sigma, size=(200_000, m)).cumsum(axis=1)
    mc = float((samples <= tau).sum(axis=1).mean())
    got = dc.expected_completed_microbatches(tau, m, mu, sigma)
    # normal latencies: the CLT form of Eq. 5 is exact; the MC error is ~ 3 / sqrt(2e5) * M
    assert got == pytest.approx(mc, abs=0.01 * m + 0.01)
    ref = sum(phi((tau - k * mu) / math.sqrt(k * sigma * sigma)) for k in range(1, m + 1))
    assert got == pytest.approx(ref, rel=1e-12)


def test_expected_completed_against_the_simulator():
    model = dc.DelayModel("normal", mean=1.0, stddev=0.25)
    trace = dc.simulate_latencies(model, 512, 8, 12, seed=5)
    for tau in (6.0, 10.0, 11.8, 13.0):
        sim = dc.evaluate_tau(trace, tau).completed
        assert dc.expected_completed_microbatches(tau, 12, 1.0, 0.25) == pytest.approx(sim,
                                                                                      abs=0.05)


def test_effective_speedup_and_compensation():
    assert dc.effective_speedup(11.0, 12, 10.0, 12.0, 0.5) == pytest.approx(
        11 * 12.5 / (12 * 10.5), rel=1e-15)
    # tau beyond T: min(tau, T) = T
    assert dc.effective_speedup(12.0, 12, 20.0, 12.0, 0.5) == pytest.approx(1.0, rel=1e-15)
    assert dc.compensation_factor(0.9 * 12, 12) == pytest.approx(1 / 0.9 - 1, rel=1e-12)
    assert dc.compensation_factor(12.0, 12) == 0.0


def test_analytic_point_matches_the_equations():
    a = dc.AnalyticModel(workers=64, micro_batches=12, mu=1.0, sigma=0.3, serial_time=0.5)
    p = dc.analytic_point(a, 12.5)
    et = 12.0 + math.sqrt(12) * 0.3 * dc.expected_max_normal(64)
    assert p.step_time == pytest.approx(et, rel=1e-12)
    mt = dc.expected_completed_microbatches(12.5, 12, 1.0, 0.3)
    assert p.completed == pytest.approx(mt, rel=1e-12)
    assert p.speedup == pytest.approx(mt * (et + 0.5) / (12 * (min(12.5, et) + 0.5)), rel=1e-12)
    best = dc.analytic_optimal_tau(a)
    assert best.speedup >= p.speedup and best.speedup > 1.0
    assert best.as_dict()["tau"] == best.tau


def test_analytic_speedup_against_simulated_speedup():
    model = dc.DelayModel("normal", mean=1.0, stddev=0.3)
    trace = dc.simulate_latencies(model, 256, 20, 12, seed=11)
    st = dc.latency_stats(trace)
    a = dc.AnalyticModel(workers=256, micro_batches=12, mu=st.mean, sigma=st.stddev,
                         serial_time=0.5)
    for tau in (11.0, 12.0, 13.0):
        sim = dc.evaluate_tau(trace, tau, serial_time=0.5).speedup
        ana = dc.analytic_point(a, tau).speedup
        assert ana == pytest.approx(sim, rel=0.03), (tau, ana, sim)


# -- traces and tau* ------------------------------------------------------------------------------
def brute_force_eval(lat, tau, tc):
    """Preemptive model of the paper, from the definition (plain Python)."""
    n_w, n_s, m = lat.shape
    t_sum = t_tau_sum = done = 0.0
    for s in range(n_s):
        t_max = t_tau_max = 0.0
        for n in range(n_w):
            cum = np.cumsum(lat[n, s])
            t_max = max(t_max, cum[-1])
            t_tau_max = max(t_tau_max, min(tau, cum[-1]))
            done += float((cum <= tau).sum())
        t_sum += t_max
        t_tau_sum += t_tau_max
    mt = done / (n_w * n_s)
    t, tt = t_sum / n_s, t_tau_sum / n_s
    return mt, mt * (t + tc) / (m * (tt + tc))


def test_evaluate_tau_matches_brute_force():
    rng = np.random.default_rng(3)
    lat = rng.lognormal(0.0, 0.5, size=(5, 4, 6))
    trace = dc.LatencyTrace(5, 4, 6, lat)
    for tau in (0.5, 3.0, 6.0, 9.0, 100.0):
        e = dc.evaluate_tau(trace, tau, serial_time=0.7)
        mt, s = brute_force_eval(lat, tau, 0.7)
        assert e.completed == pytest.approx(mt, rel=1e-12)
        assert e.speedup == pytest.approx(s, rel=1e-12)
        assert e.drop_rate == pytest.approx(1 - mt / 6, abs=1e-12)


def heavy_straggler_trace():
    lat = np.ones((8, 3, 4))
    lat[5] = 10.0
    return dc.LatencyTrace(8, 3, 4, lat), lat


def test_tau_search_known_answer_with_a_heavy_straggler():
    trace, lat = heavy_straggler_trace()
    best = dc.find_optimal_tau(trace, serial_time=1.0)
    # at tau = 4 the seven normal workers finish all 4 micro-batches, the straggler none:
    # S = 3.5 * 41 / (4 * 5)
    assert best.tau == 4.0
    assert best.speedup == pytest.approx(3.5 * 41 / 20, rel=1e-12)
    assert best.drop_rate == pytest.approx(0.125, rel=1e-12)
    # it is the maximum over a fine grid (brute force)
    grid = np.linspace(0.1, 45.0, 2000)
    assert max(brute_force_eval(lat, t, 1.0)[1] for t in grid) <= best.speedup + 1e-12


def test_tau_search_is_deterministic_bitwise():
    rng = np.random.default_rng(9)
    lat = rng.lognormal(-1.0, 1.0, size=(16, 5, 12))
    a = dc.find_optimal_tau(dc.LatencyTrace(16, 5, 12, lat), serial_time=0.3)
    b = dc.find_optimal_tau(dc.LatencyTrace(16, 5, 12, lat.copy()), serial_time=0.3)
    c = dc.find_optimal_tau(dc.trace_from_histories(list(lat)), serial_time=0.3)
    assert bits(a.tau) == bits(b.tau) == bits(c.tau)
    assert bits(a.speedup) == bits(b.speedup) == bits(c.speedup)


def test_tau_search_without_variance_does_not_drop():
    trace = dc.LatencyTrace(4, 3, 6, np.full((4, 3, 6), 0.25))
    for model in ("preemptive", "boundary"):
        best = dc.find_optimal_tau(trace, serial_time=0.1, stop_model=model)
        assert best.drop_rate == 0.0
        assert best.speedup == pytest.approx(1.0, abs=1e-12)
        assert best.tau >= 1.5


def test_latency_trace_round_trip_and_serial_time():
    lat = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) / 10
    t = dc.LatencyTrace(2, 3, 4, lat)
    np.testing.assert_array_equal(t.latency, lat)
    assert t.at(1, 2, 3) == lat[1, 2, 3]
    walls = np.array([[10.0, 11.0, 12.0], [10.2, 11.2, 12.2]])
    tmax = lat.sum(axis=2).max(axis=0)
    assert dc.serial_time_from_walls(t, walls) == pytest.approx(
        float(np.mean(walls.mean(axis=0) - tmax)), rel=1e-12)


# -- controller, normalisation --------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("point,expected", [("before_forward", 4), ("after_backward", 4),
                                            ("between_forward_backward", 3)])
def test_controller_drop_points(point, expected):
    clk = Clock()
    c = dc.ThresholdController(10, tau=3.4, drop_point=point, clock=clk)
    c.begin_step()
    done = 0
    while c.proceed("before_forward"):
        clk.t += 0.5  # forward
        if not c.proceed("between_forward_backward"):
            break
        clk.t += 0.5  # backward
        c.micro_batch_done()
        done += 1
        if not c.proceed("after_backward"):
            break
    rec = c.end_step()
    assert done == expected == rec.completed and rec.dropped


def test_controller_history_records_complete_steps():
    clk = Clock()
    c = dc.ThresholdController(3, history_steps=2, clock=clk)
    for step in range(3):
        c.begin_step()
        while c.proceed("before_forward"):
            clk.t += 0.25 * (1 + step)
            c.micro_batch_done()
        c.end_step()
    np.testing.assert_array_equal(c.history, [[0.5] * 3, [0.75] * 3])
    assert c.history_steps == 2


def test_gradient_scale():
    assert dc.gradient_scale("actual", 4, 12, 45) == 1 / 45
    assert dc.gradient_scale("nominal", 4, 12, 45) == 1 / 48
    assert dc.gradient_scale("actual", 4, 12, 0) == 0.0
    with pytest.raises(ValueError, match="total_completed"):
        dc.gradient_scale("actual", 4, 12, 49)
    with pytest.raises(ValueError, match="normalization"):
        dc.gradient_scale("mean", 4, 12, 4)


def test_delay_model_moments_against_monte_carlo():
    m = dc.DelayModel("lognormal", mean=1.0, stddev=0.05, log_mu=-2.0, log_sigma=1.5, cap=3.0)
    mom = dc.latency_moments(m)
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 0.05, 2_000_000) + np.minimum(np.exp(rng.normal(-2.0, 1.5, 2_000_000)), 3)
    assert mom.mean == pytest.approx(x.mean(), rel=2e-3)
    assert mom.stddev == pytest.approx(x.std(), rel=5e-3)
    t = dc.simulate_latencies(m, 64, 50, 12, seed=1)
    st = dc.latency_stats(t)
    assert st.mean == pytest.approx(mom.mean, rel=0.02)
    same = dc.simulate_latencies(m, 64, 50, 12, seed=1)
    np.testing.assert_array_equal(t.latency, same.latency)


def test_curves_have_the_paper_shape():
    m = dc.DelayModel("lognormal", mean=1.0, stddev=0.05, log_mu=-2.0, log_sigma=1.5, cap=3.0)
    pts = dc.scale_curve(m, [1, 16, 256], 10, 12, seed=0, serial_time=0.5)
    assert [p.workers for p in pts] == [1, 16, 256]
    assert pts[-1].dropcompute > pts[-1].baseline  # DropCompute scales better at large N
    trace = dc.simulate_latencies(m, 64, 10, 12, seed=0)
    curve = dc.tau_curve(trace, 8.0, 30.0, 9, serial_time=0.5)
    assert len(curve) == 9
    assert curve[0].simulated.drop_rate > curve[-1].simulated.drop_rate


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="tau"):
        dc.ThresholdController(4, tau=0.0)
    with pytest.raises(ValueError, match="tau"):
        dc.ThresholdController(4, tau=-1.0)
    with pytest.raises(ValueError, match="tau"):
        dc.ThresholdController(4, tau=float("nan"))
    with pytest.raises(ValueError, match="micro_batches"):
        dc.ThresholdController(0)
    with pytest.raises(ValueError, match="tau"):
        dc.expected_completed_microbatches(0.0, 12, 1.0, 0.1)
    with pytest.raises(ValueError, match="M"):
        dc.expected_completed_microbatches(1.0, 0, 1.0, 0.1)
    with pytest.raises(ValueError):
        dc.LatencyTrace(2, 1, 3, [])
    with pytest.raises(ValueError, match="empty"):
        dc.LatencyTrace(0, 1, 3, np.zeros(0))
    with pytest.raises(ValueError, match="nan"):
        dc.LatencyTrace(2, 1, 3, [1, 1, 1, 1, 1, float("nan")])
    with pytest.raises(ValueError, match="worker 1, step 0, micro-batch 2"):
        dc.LatencyTrace(2, 1, 3, [1, 1, 1, 1, 1, -1.0])
    with pytest.raises(ValueError, match="shape"):
        dc.LatencyTrace(2, 1, 3, np.ones((2, 3, 1)))
    with pytest.raises(ValueError, match="no latency"):
        dc.trace_from_histories([])
    trace = dc.LatencyTrace(2, 1, 3, np.ones(6))
    with pytest.raises(ValueError, match="tau"):
        dc.evaluate_tau(trace, 0.0)
    with pytest.raises(ValueError, match="serial"):
        dc.estimate_tau(trace, float("nan"))
    with pytest.raises(ValueError, match="stop model"):
        dc.find_optimal_tau(trace, stop_model="sometimes")
    with pytest.raises(ValueError, match="drop point"):
        dc.ThresholdController(4, drop_point="never")
    with pytest.raises(ValueError, match="clock"):
        dc.ThresholdController(4, clock=3.0)


def test_rejected_set_tau_keeps_the_threshold():
    c = dc.ThresholdController(4, tau=2.0)
    with pytest.raises(ValueError, match="tau"):
        c.set_tau(0.0)
    with pytest.raises(ValueError, match="tau"):
        c.set_tau(float("nan"))
    assert c.tau == 2.0
    c.begin_step()
    with pytest.raises(ValueError, match="already open"):
        c.begin_step()
    assert c.in_step


def test_python_clock_errors_propagate():
    def broken():
        raise KeyError("clock broke")
    c = dc.ThresholdController(2, tau=1.0, clock=broken)
    with pytest.raises(KeyError, match="clock broke"):
        c.begin_step()


def test_top_level_package_exports():
    assert gradcomp.dropcompute.qsr_period is dc.qsr_period


def test_monotonic_clock_does_not_go_back():
    t = [dc.monotonic_seconds() for _ in range(1000)]
    assert all(b >= a for a, b in zip(t, t[1:])) and t[-1] > 0
