#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DropCompute on simulated-delay training: 4 CPU ranks (gloo on loopback), M micro-batches per
step, each micro-batch's real forward/backward followed by an added delay drawn from the paper's
delay environment (a base latency plus a bounded log-normal noise, in milliseconds).

For each compressor (none, and the gradcomp top-k DDP hook when its plan binding is built, else
PyTorch's fp16 compression hook as a stand-in) it trains with the usual accumulation loop
(baseline) and with DropCompute (automatic tau after a warm-up), and reports: time per step, drop
rate, the effective speedup S_eff = (micro-batches per second with DropCompute) / (micro-batches
per second of the baseline), and beside it three predictions at the chosen tau:
  pred_trace     the empirical S_eff of the warm-up trace (what DropCompute optimised),
  pred_sim       the simulator (simulate_latencies of the injected delay model plus the measured
                 compute overhead, 4 workers, many steps; the same stop model as the run),
  pred_analytic  Eq. 4-6 with the trace's mean/stddev and measured serial time.

    python3 -m experiments.dropcompute_experiment [--steps 60] [--warmup 20] [--out results.csv]
Target: S_eff within 20% of the analytic prediction and >= 1.1x at the chosen tau.
The default delay (6 ms + min(exp(N(ln 2, 2^2)), 80) ms; about 0.13 s per step) keeps the fixed
per-micro-batch overheads of a loaded 2-core machine small next to the injected variance; with
half of it (--base-ms 3 --log-mu 0 --cap-ms 40) runs measured S_eff 1.02-1.11 against 1.10
predicted (scheduler noise of 4 processes on 2 shared cores).
"""
import argparse
import csv
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp import dropcompute as dcm
from experiments.launch import free_port
from gradcomp.torch.dropcompute import DropCompute


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=12)
    p.add_argument("--steps", type=int, default=100, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=20, help="DropCompute's measured warm-up steps")
    p.add_argument("--base-ms", type=float, default=6.0, help="base delay per micro-batch (ms)")
    p.add_argument("--log-mu", type=float, default=0.6931, help="log-normal noise: mean of log(ms)")
    p.add_argument("--log-sigma", type=float, default=2.0)
    p.add_argument("--cap-ms", type=float, default=80.0, help="bound of the noise (ms)")
    p.add_argument("--batch", type=int, default=16, help="samples per micro-batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compressors", default="none,topk")
    p.add_argument("--out", default="build/bench/dropcompute_experiment.csv")
    return p.parse_args()


def make_model():
    torch.manual_seed(0)
    # small: the added delay, not the (shared, 2-core) CPU, must dominate the micro-batch time
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def attach_hook(ddp, name):
    """Returns the label of the compressor actually used."""
    if name == "none":
        return "none"
    if name == "topk":
        if hasattr(gradcomp._C, "TopKAllreducePlan"):
            ddp.register_comm_hook(*gradcomp.torch.hook("topk", ratio=0.01))
            return "gradcomp-topk-0.01"
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        ddp.register_comm_hook(None, fp16_compress_hook)
        return "torch-fp16 (gradcomp top-k plan not built)"
    raise ValueError(f"unknown compressor {name}")


def worker(rank, world, port, args, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    M = args.micro_batches
    rows = []
    for comp in args.compressors.split(","):
        for use_dc in (False, True):
            ddp = DDP(make_model())
            label = attach_hook(ddp, comp)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            # common random numbers: micro-batch m of measured step s draws the same delay in the
            # baseline and in the DropCompute run (warm-up steps draw from another stream)
            cur = {"delays": None, "m": 0}

            def new_step(index):
                r = np.random.default_rng([args.seed, rank, index])
                noise = np.minimum(np.exp(r.normal(args.log_mu, args.log_sigma, M)), args.cap_ms)
                cur["delays"] = (args.base_ms + noise) / 1e3
                cur["m"] = 0
            g = torch.Generator().manual_seed(1000 + rank)
            xs = torch.randn(64, args.batch, 32, generator=g)
            ys = torch.randn(64, args.batch, 1, generator=g)
            compute_s = []

            def data():
                i = 0
                while True:
                    yield xs[i % 64], ys[i % 64]
                    i += 1

            def micro_batch(x, y, scale):
                t0 = time.perf_counter()
                loss = torch.nn.functional.mse_loss(ddp(x), y) * scale
                loss.backward()
                compute_s.append(time.perf_counter() - t0)
                time.sleep(cur["delays"][cur["m"]])
                cur["m"] += 1

            it = data()
            dc = None
            if use_dc:
                dc = DropCompute(ddp, M, tau=None, warmup_steps=args.warmup)

            def step(index):
                new_step(index)
                opt.zero_grad()
                if dc is None:
                    for m in range(M):
                        x, y = next(it)
                        if m < M - 1:
                            with ddp.no_sync():
                                micro_batch(x, y, 1.0 / M)
                        else:
                            micro_batch(x, y, 1.0 / M)
                    done = M
                else:
                    for x, y in dc.microbatches(it):
                        micro_batch(x, y, 1.0)
                    done = dc.last["completed"]
                opt.step()
                return done

            warm = args.warmup + 2 if use_dc else 3
            for i in range(warm):
                step(1_000_000 + i)
            dist.barrier()
            t0 = time.perf_counter()
            done = 0
            for i in range(args.steps):
                done += step(i)
            dist.barrier()
            wall = time.perf_counter() - t0
            totals = torch.tensor([float(done), wall, float(np.mean(compute_s))],
                                  dtype=torch.float64)
            outs = [torch.empty_like(totals) for _ in range(world)]
            dist.all_gather(outs, totals)
            row = {"compressor": label, "dropcompute": use_dc,
                   "done": sum(float(o[0]) for o in outs),
                   "wall": max(float(o[1]) for o in outs),
                   "compute_ms": 1e3 * float(np.mean([float(o[2]) for o in outs]))}
            if use_dc:
                est = dc.estimates[0]
                row.update(tau=est["tau"], pred_trace=est["speedup"],
                           pred_drop=est["drop_rate"], serial_time=est["serial_time"],
                           lat_mean=est["latency_mean"], lat_std=est["latency_stddev"])
            rows.append(row)
            dist.barrier()
    if rank == 0:
        out_q.put(rows)
    dist.barrier()
    dist.destroy_process_group()
    # torch 1.13 can deadlock when the last reference to a gloo process group dies in a DDP
    # reducer's destructor (its worker thread waits for the GIL the destructor holds): leave
    # without running destructors, the results are out already
    os._exit(0)


def predictions(args, row, world):
    M = args.micro_batches
    tau, tc = row["tau"], row["serial_time"]
    # the simulator: the injected delay (ms -> s) shifted by the measured compute time
    model = dcm.DelayModel("lognormal", mean=args.base_ms / 1e3 + row["compute_ms"] / 1e3,
                           stddev=0.0, log_mu=args.log_mu + math.log(1e-3),
                           log_sigma=args.log_sigma, cap=args.cap_ms / 1e3)
    trace = dcm.simulate_latencies(model, world, 4000, M, seed=args.seed + 17)
    sim = dcm.evaluate_tau(trace, tau, serial_time=tc, stop_model="boundary")
    ana = dcm.analytic_point(dcm.AnalyticModel(workers=world, micro_batches=M, mu=row["lat_mean"],
                                               sigma=row["lat_std"], serial_time=tc), tau)
    return sim, ana


def main():
    args = parse()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(worker, args=(args.world, port, args, q), nprocs=args.world, join=True)
    rows = q.get()
    M, N = args.micro_batches, args.world
    table = []
    base = {}
    for r in rows:
        thr = r["done"] / r["wall"]  # micro-batches per second, all ranks
        rec = {"compressor": r["compressor"], "dropcompute": r["dropcompute"],
               "step_ms": 1e3 * r["wall"] / args.steps,
               "drop_rate": 1.0 - r["done"] / (N * M * args.steps),
               "mb_per_s": thr, "compute_ms": r["compute_ms"]}
        if not r["dropcompute"]:
            base[r["compressor"]] = thr
            rec.update(tau_ms=float("nan"), speedup=1.0)
        else:
            sim, ana = predictions(args, r, N)
            s = thr / base[r["compressor"]]
            rec.update(tau_ms=1e3 * r["tau"], speedup=s, pred_trace=r["pred_trace"],
                       pred_sim=sim.speedup, pred_analytic=ana.speedup,
                       pred_drop_trace=r["pred_drop"], pred_drop_sim=sim.drop_rate,
                       pred_drop_analytic=ana.drop_rate, serial_ms=1e3 * r["serial_time"],
                       err_vs_analytic=s / ana.speedup - 1.0, err_vs_sim=s / sim.speedup - 1.0)
        table.append(rec)
    cols = ["compressor", "dropcompute", "tau_ms", "step_ms", "drop_rate", "mb_per_s", "speedup",
            "pred_trace", "pred_sim", "pred_analytic", "err_vs_analytic", "err_vs_sim",
            "pred_drop_trace", "pred_drop_sim", "pred_drop_analytic", "serial_ms", "compute_ms"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for rec in table:
            w.writerow({k: rec.get(k, "") for k in cols})
    print(f"N = {N} ranks (gloo, CPU), M = {M}, delay = {args.base_ms} ms + min(exp(N({args.log_mu}"
          f", {args.log_sigma}^2)), {args.cap_ms}) ms per micro-batch, {args.steps} steps each")
    hdr = (f"{'compressor':44s} {'DC':>3s} {'tau ms':>7s} {'step ms':>8s} {'drop':>6s} "
           f"{'mb/s':>7s} {'S_eff':>6s} {'trace':>6s} {'sim':>6s} {'anal.':>6s} {'err':>6s}")
    print(hdr)
    print("-" * len(hdr))
    for rec in table:
        def f(k, fmt):
            v = rec.get(k)
            return format(v, fmt) if isinstance(v, float) and not math.isnan(v) else "-"
        print(f"{rec['compressor'][:44]:44s} {'yes' if rec['dropcompute'] else 'no':>3s} "
              f"{f('tau_ms', '7.1f'):>7s} {f('step_ms', '8.1f'):>8s} {f('drop_rate', '6.3f'):>6s} "
              f"{f('mb_per_s', '7.1f'):>7s} {f('speedup', '6.3f'):>6s} "
              f"{f('pred_trace', '6.3f'):>6s} "
              f"{f('pred_sim', '6.3f'):>6s} {f('pred_analytic', '6.3f'):>6s} "
              f"{f('err_vs_analytic', '+6.1%'):>6s}")
    ok = all(r["speedup"] >= 1.1 and abs(r["err_vs_analytic"]) <= 0.2
             for r in table if r["dropcompute"])
    print(f"target (S_eff >= 1.1x and within 20% of the analytic prediction): "
          f"{'met' if ok else 'NOT met'}; CSV: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
