# SPDX-License-Identifier: Apache-2.0
"""What each DDP hook does with a loss-scaler overflow on one rank.

Two gloo ranks on 127.0.0.1 train a small MLP (DDP, 12 steps, SGD) with one hook; at step 6
rank 1's loss is multiplied by Inf, as an fp16 overflow does. The loop is a GradScaler's: a step
whose averaged gradients are not all finite is skipped. Per hook it reports whether the job
survived, which steps came out non-finite on rank 0, and whether training went on after the
overflow (every later step finite). Hooks: plain DDP (no hook), gradcomp's fp16, topk, randomk,
onebit and powersgd with their defaults, the same with check_finite=False, and PyTorch's own
powerSGD_hook (PowerSGDState(process_group=None, matrix_approximation_rank=2,
start_powerSGD_iter=2)).

    python -m experiments.overflow_table --out experiments/results/overflow_<date>.md

Writes a markdown table with the date, commit, command, torch version and machine load.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from experiments.launch import free_port

STEPS, BAD = 12, 6

CONFIGS = [
    ("plain DDP", None, {}),
    ("gradcomp fp16", "fp16", {}),
    ("gradcomp topk", "topk", dict(ratio=0.01)),
    ("gradcomp randomk", "randomk", dict(ratio=0.05, dense_below=1000)),
    ("gradcomp onebit", "onebit", {}),
    ("gradcomp powersgd", "powersgd", dict(rank=2)),
    ("gradcomp topk, check_finite=False", "topk", dict(ratio=0.01, check_finite=False)),
    ("gradcomp onebit, check_finite=False", "onebit", dict(check_finite=False)),
    ("gradcomp powersgd, check_finite=False", "powersgd", dict(rank=2, check_finite=False)),
    ("PyTorch powerSGD_hook", "torch-powersgd", {}),
]




def _rank(rank, world, port, hook, opts, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 8)))
    if hook == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
        model.register_comm_hook(ph.PowerSGDState(process_group=None,
                                                  matrix_approximation_rank=2,
                                                  start_powerSGD_iter=2), ph.powerSGD_hook)
    elif hook is not None:
        import gradcomp.torch as gt
        state, h = gt.hook(hook, **opts)
        model.register_comm_hook(state, h)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    record = {"nonfinite": [], "error": None}
    try:
        for s in range(STEPS):
            x = torch.randn(16, 32, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
            if s == BAD and rank == 1:
                loss = loss * float("inf")
            loss.backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
            else:
                record["nonfinite"].append(s)
    except Exception as e:  # what the user sees
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a rank whose peer died would wait in it


def run_one(hook, opts, timeout=120):
    out = tempfile.mkdtemp(prefix="overflow-")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, hook, opts, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    recs = {}
    for r in range(2):
        path = os.path.join(out, f"rank{r}.json")
        recs[r] = json.load(open(path)) if os.path.exists(path) else None
    return recs, [p.exitcode for p in procs]


def describe(recs) -> tuple:
    r0, r1 = recs[0], recs[1]
    if r0 is None or r1 is None:
        return "no (a rank died)", "-", "-"
    errs = [f"rank {r}: {x['error']}" for r, x in recs.items() if x["error"]]
    if errs:
        return "no: " + "; ".join(errs), str(r0["nonfinite"]), "-"
    bad = r0["nonfinite"]
    went_on = "yes" if bad == [BAD] else ("no: non-finite at every later step"
                                          if bad and bad[-1] == STEPS - 1 else f"steps {bad}")
    return "yes", str(bad), went_on


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for label, hook, opts in CONFIGS:
        recs, codes = run_one(hook, opts)
        survived, bad, went_on = describe(recs)
        rows.append((label, survived, bad, went_on))
        print(label, "|", survived, "|", bad, "|", went_on, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()
    with open(args.out, "w") as f:
        f.write("# A loss-scaler overflow on one rank, per DDP hook\n\n")
        f.write(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
        f.write(f"- commit: {commit}{' (with uncommitted changes)' if dirty else ''}\n")
        f.write(f"- command: `python -m experiments.overflow_table --out {args.out}`\n")
        f.write(f"- torch {torch.__version__}, 2 gloo ranks on 127.0.0.1, "
                f"load average before the run {load[0]:.2f}\n")
        f.write(f"- setup: MLP 32-256-256-8, {STEPS} steps, rank 1's loss x Inf at step {BAD}; a "
                "step whose averaged gradients are not all finite is skipped (GradScaler's rule)"
                "\n\n")
        f.write("| hook | job survived | non-finite steps (rank 0) | training went on |\n")
        f.write("|---|---|---|---|\n")
        for r in rows:
            f.write("| " + " | ".join(r) + " |\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
