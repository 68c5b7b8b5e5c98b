#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PNG plots of the DropCompute paper's Figure 1 (throughput vs workers) and Figure 3 (S_eff and
completion rate vs tau), simulated vs analytical, from the CSV of bench/dropcompute_sim.

    python3 -m experiments.plot_dropcompute                       # runs build/bench/dropcompute_sim
    python3 -m experiments.plot_dropcompute --scale s.csv --tau t.csv --outdir build/bench
    python3 -m experiments.plot_dropcompute --sim-args "--dist normal --stddev 0.3"

Writes dropcompute_fig1_scale.png and dropcompute_fig3_tau.png (matplotlib, Agg backend).
"""
import argparse
import csv
import io
import os
import shlex
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_csv(text):
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise SystemExit("empty CSV")
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def load(path, sim, mode, extra):
    if path:
        with open(path) as f:
            return read_csv(f.read())
    if not os.path.exists(sim):
        raise SystemExit(f"{sim} not found: build it (cmake --build build --target "
                         f"dropcompute_sim) or pass --{mode} CSV")
    out = subprocess.run([sim, mode] + shlex.split(extra), check=True, capture_output=True,
                         text=True)
    sys.stderr.write(out.stderr)
    return read_csv(out.stdout)


def fig1(d, path, title):
    fig, (ax, ae) = plt.subplots(1, 2, figsize=(11, 4.4))
    w = d["workers"]
    curves = [("baseline_sim", "o-", "tab:blue", "synchronous, simulated"),
              ("baseline_analytic", "--", "tab:blue", "synchronous, analytic (Eq. 4)"),
              ("dropcompute_sim", "s-", "tab:red", "DropCompute, simulated"),
              ("dropcompute_analytic", "--", "tab:red", "DropCompute, analytic (Eq. 4-6)")]
    ax.plot(w, d["linear"], "k:", label="linear scaling")
    ae.plot(w, [1.0] * len(w), "k:", label="linear scaling")
    for key, style, color, label in curves:
        ax.plot(w, d[key], style, color=color, label=label)
        ae.plot(w, [v / n for v, n in zip(d[key], d["linear"])], style, color=color, label=label)
    for a_ in (ax, ae):
        a_.set_xscale("log", base=2)
        a_.set_xlabel("workers N")
        a_.grid(True, which="both", alpha=0.3)
        a_.legend(fontsize=8)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("throughput (x one worker without variance)")
    ax.set_title("throughput")
    ae.set_ylabel("throughput / N")
    ae.set_title("scaling efficiency")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fig3(d, path, title):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    tau = d["tau"]
    opt = [i for i, o in enumerate(d["optimal"]) if o == 1.0]
    a1.plot(tau, d["speedup_sim"], "-", color="tab:red", label="simulated")
    a1.plot(tau, d["speedup_analytic"], "--", color="tab:green", label="analytic (Eq. 4-6)")
    a1.plot(tau, d["speedup_analytic_given_t"], ":", color="tab:purple",
            label="analytic given simulated E[T]")
    if opt:
        i = opt[0]
        a1.axvline(tau[i], color="gray", lw=0.8)
        a1.plot([tau[i]], [d["speedup_sim"][i]], "k*", ms=10,
                label=f"tau* = {tau[i]:.3g} (S_eff {d['speedup_sim'][i]:.3f})")
    a1.axhline(1.0, color="k", lw=0.6)
    a1.set_xlabel("compute threshold tau")
    a1.set_ylabel("effective speedup S_eff")
    a1.set_title("effective speedup")
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(tau, d["completion_rate_sim"], "-", color="tab:red", label="completion rate, simulated")
    a2.plot(tau, d["completion_rate_analytic"], "--", color="tab:green",
            label="completion rate, analytic (Eq. 5)")
    a2.plot(tau, d["step_speedup_sim"], "-", color="tab:blue", label="step speedup, simulated")
    a2.plot(tau, d["step_speedup_analytic"], "--", color="tab:cyan",
            label="step speedup, analytic")
    a2.set_xlabel("compute threshold tau")
    a2.set_title("completion rate E[M~]/M and step-time speedup")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", default="build/bench/dropcompute_sim")
    p.add_argument("--scale", help="CSV of `dropcompute_sim scale` (default: run it)")
    p.add_argument("--tau", help="CSV of `dropcompute_sim tau` (default: run it)")
    p.add_argument("--sim-args", default="", help="extra options for dropcompute_sim")
    p.add_argument("--outdir", default="build/bench")
    a = p.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    desc = "delay: N(1, 0.05^2) + min(exp(N(-2, 1.5^2)), 3), M = 12, Tc = 0.5"
    if a.sim_args:
        desc = "dropcompute_sim " + a.sim_args
    s = load(a.scale, a.sim, "scale", a.sim_args)
    f1 = os.path.join(a.outdir, "dropcompute_fig1_scale.png")
    fig1(s, f1, "Fig. 1: scaling with workers, " + desc)
    t = load(a.tau, a.sim, "tau", a.sim_args)
    f3 = os.path.join(a.outdir, "dropcompute_fig3_tau.png")
    fig3(t, f3, "Fig. 3: S_eff vs tau (N = 64 unless --workers)\n" + desc)
    print(f1)
    print(f3)


if __name__ == "__main__":
    main()
