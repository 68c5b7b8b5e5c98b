# SPDX-License-Identifier: Apache-2.0
"""gloo's allgather (a ring: P - 1 rounds one after the other) against the same exchange as
isend / irecv pairs all in flight at once (gradcomp.torch._driver's choice on gloo), on
loopback, without and with the latency group's one-way latency per round. Writes a markdown
table with the run's context.

    .venv-torch2/bin/python -m experiments.allgather_p2p --out experiments/results/<folder>/allgather_p2p.md
"""
import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (64, 1024, 16384, 262144, 4194304)


def _worker(rank, world, port, lat, reps, q):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from experiments import latency
    from gradcomp.torch import _driver

    backend = "gloo"
    if lat > 0:
        latency.register(lat)
        backend = latency.BACKEND
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    res = {}
    for nbytes in SIZES:
        send = torch.full((nbytes // 4,), float(rank))
        recv = torch.empty(world * send.numel())
        outs = list(recv.chunk(world))
        ways = (("ring", lambda: dist.all_gather(outs, send)),
                ("pairs", lambda: _driver._all_gather_p2p(recv, send, world, None).wait()))
        for rep in range(reps):
            for name, fn in (ways if rep % 2 == 0 else ways[::-1]):
                recv.zero_()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                res.setdefault((nbytes, name), []).append(time.perf_counter() - t0)
                assert all(o[0].item() == i for i, o in enumerate(outs)), name
    med = torch.tensor([statistics.median(res[(n, w)]) for n in SIZES for w in ("ring", "pairs")],
                       dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
    if rank == 0:
        q.put(med.tolist())
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--latencies", default="0,0.025", help="one way per round, seconds")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    ctx = mp.get_context("spawn")
    for world in [int(w) for w in a.worlds.split(",")]:
        for lat in [float(x) for x in a.latencies.split(",")]:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            q = ctx.SimpleQueue()
            mp.spawn(_worker, args=(world, port, lat, a.reps if lat == 0 else 3, q), nprocs=world)
            med = q.get()
            for i, n in enumerate(SIZES):
                rows.append((world, lat, n, med[2 * i], med[2 * i + 1]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(a.out, "w") as f:
        f.write("# gloo's allgather (ring) against isend/irecv pairs, loopback\n\n")
        f.write(f"- Date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                f"commit {commit}, torch {torch.__version__}, {os.cpu_count()}-core VM; load "
                f"average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}.\n")
        f.write(f"- Command: `{' '.join([os.path.basename(sys.executable)] + sys.argv)}`\n")
        f.write("- Each rank one thread; the latency (one way, per message round) from "
                "experiments.latency; time = the slowest rank's median over the "
                "repetitions (9 without latency, 3 with), both ways interleaved.\n\n")
        f.write("| ranks | one-way latency ms | bytes per rank | ring ms | pairs ms | ring / pairs |\n")
        f.write("|---|---|---|---|---|---|\n")
        for world, lat, n, ring, pairs in rows:
            f.write(f"| {world} | {1e3 * lat:g} | {n:,} | {1e3 * ring:.2f} | {1e3 * pairs:.2f} | "
                    f"{ring / pairs:.2f} |\n")
    print(open(a.out).read())


if __name__ == "__main__":
    main()
