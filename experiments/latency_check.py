# SPDX-License-Identifier: Apache-2.0
"""Checks the latency emulation (experiments.latency) against the alpha-beta model.

For each added one-way latency L (and optionally over links of one rate, in network namespaces:
--netns RATE, root): a ping-pong of one float between ranks 0 and 1, and an allreduce of every
size in --sizes, each timed over --reps repetitions after a warm-up. Per L it fits
t(bytes) = a + bytes / B to the allreduce medians (least squares) and compares with the model:
a - a(L=0) against rounds("allreduce", P) * L, the ping-pong against 2 L + its L=0 time, and B
against B(L=0) (the latency must not change the bandwidth term). Writes a JSON of every timing
and a markdown table.

    .venv-torch2/bin/python -m experiments.latency_check --world 2 --latencies 0,0.005,0.05 \
        --out experiments/results/latency_check_<date>
    sudo .venv-torch2/bin/python -m experiments.latency_check --netns 1gbit ...
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from experiments import latency, netem
from experiments.launch import exit_rank, free_port, start_ranks


def _measure(rank, world, init, lat, sizes, reps, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    latency.register(lat)
    dist.init_process_group(latency.BACKEND, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    res = {"pingpong": [], "allreduce": {}}
    one = torch.zeros(1)
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(one, 1)
            dist.recv(one, 1)
        elif rank == 1:
            dist.recv(one, 0)
            dist.send(one, 0)
        if i:
            res["pingpong"].append(time.perf_counter() - t0)
    for n in sizes:
        x = torch.ones(n // 4)
        ts = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i:
                ts.append(time.perf_counter() - t0)
        res["allreduce"][str(n)] = ts
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def _fit(xs, ys):
    """Least squares y = a + b x; returns (a, b)."""
    b, a = np.polyfit(np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64), 1)
    return float(a), float(b)


def run_one(world, lat, sizes, reps, netns, timeout, tmp):
    out = os.path.join(tmp, f"lat-{lat}.json")
    if netns:
        cmd = lambda r: [sys.executable, "-m", "experiments.latency_check", "--_rank", str(r),  # noqa
                         "--world", str(world), "--_lat", str(lat), "--_init",
                         f"tcp://{netem.RANK0_ADDR}:29517", "--_out", out, "--reps", str(reps),
                         "--sizes", ",".join(map(str, sizes))]
        netem.run_in_namespaces(world, netns, cmd, timeout=timeout)
    else:
        start_ranks(_measure, (world, f"tcp://127.0.0.1:{free_port()}", lat, sizes, reps, out),
                    world)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--latencies", default="0,0.005,0.05", help="one-way seconds, comma-separated")
    ap.add_argument("--sizes", default="4096,65536,1048576,4194304,16777216", help="bytes")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--netns", default="", help="link rate in namespaces (root), e.g. 1gbit")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="", help="directory for results.json and results.md")
    ap.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_lat", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--_init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a._rank is not None:
        _measure(a._rank, a.world, a._init, a._lat, sizes, a.reps, a._out)
        return 0
    lats = [float(s) for s in a.latencies.split(",")]
    if 0.0 not in lats:
        lats = [0.0] + lats
    import tempfile

    tmp = tempfile.mkdtemp(prefix="gradcomp-latency-")
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    raw = {lat: run_one(a.world, lat, sizes, a.reps, a.netns, a.timeout, tmp) for lat in lats}
    k = latency.rounds("allreduce", a.world)
    base = None
    rows = []
    for lat in lats:
        r = raw[lat]
        med = {int(n): statistics.median(ts) for n, ts in r["allreduce"].items()}
        a0, b = _fit(list(med), list(med.values()))
        pp = statistics.median(r["pingpong"])
        if base is None:
            base = (a0, b, pp)
        rows.append({"latency_s": lat, "alpha_fit_s": a0,
                     "bandwidth_Bps": 1.0 / b if b > 0 else None,
                     "alpha_added_s": a0 - base[0], "alpha_model_s": k * lat,
                     "pingpong_s": pp, "pingpong_added_s": pp - base[2],
                     "pingpong_model_s": 2 * lat,
                     "allreduce_median_s": {str(n): v for n, v in med.items()}})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    meta = {"date": started.isoformat(timespec="seconds"), "commit": commit,
            "command": " ".join(sys.argv), "machine": platform.node(), "torch": torch.__version__,
            "load_before": load_before, "load_after": os.getloadavg(), "world": a.world,
            "rounds_allreduce": k, "netns": a.netns or "loopback", "reps": a.reps}
    lines = [f"| one-way latency (ms) | alpha fit (ms) | added (ms) | model {k} x L (ms) | "
             f"bandwidth fit (MB/s) | ping-pong (ms) | added (ms) | model 2 L (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        bw = row["bandwidth_Bps"]
        lines.append(f"| {1e3 * row['latency_s']:.1f} | {1e3 * row['alpha_fit_s']:.2f} | "
                     f"{1e3 * row['alpha_added_s']:.2f} | {1e3 * row['alpha_model_s']:.2f} | "
                     f"{bw / 1e6 if bw else float('nan'):.0f} | {1e3 * row['pingpong_s']:.2f} | "
                     f"{1e3 * row['pingpong_added_s']:.2f} | {1e3 * row['pingpong_model_s']:.2f} |")
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows,
                       "raw": {str(k_): v for k_, v in raw.items()}}, f, indent=1)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(f"Latency emulation against the alpha-beta model: {meta['world']} ranks, "
                    f"{meta['netns']}, {a.reps} repetitions per point (medians).\n\n"
                    + "\n".join(f"- {k_}: {v}" for k_, v in meta.items()) + "\n\n"
                    + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
