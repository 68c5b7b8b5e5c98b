# SPDX-License-Identifier: Apache-2.0
"""DDP training of a communication-bound model on CPU ranks with gloo: plain DDP, PyTorch's own
communication hooks (fp16_compress_hook, powerSGD_hook) and gradcomp's hooks.

Every rank is a process on 127.0.0.1 (torch.multiprocessing, gloo, one intra-op thread each).
The model is a stack of wide Linear layers (tens of millions of parameters) fed a tiny batch, so
a step is dominated by the gradient allreduce. All configurations run in the same processes one
after another (a fresh DDP model, hook and optimizer each), so they see the same machine; with
``--rounds 2`` the list runs twice, the second time in reverse order, and each configuration
keeps its best round (the machine may be shared).

Per configuration: ``--warmup`` steps (covering DDP's bucket rebuild and the hooks' plain
start iterations), then ``--steps`` timed steps. Step time = the slowest rank's time for that
step (forward, backward with the hook's communication, optimizer step); steps/s = 1 / median step
time; mean step time also reported.

Bytes per step = bytes handed to collectives by one rank per step (not ring traffic):
- gradcomp hooks: measured, ``state.history[i]["bytes_sent"]`` averaged over the timed steps;
- plain DDP and PyTorch's hooks: computed (marked "analytic"): plain n*4, fp16 n*2, PowerSGD
  sum over compressed matrices (rows + cols) * r * 4 plus 4 bytes per uncompressed element
  (1-D tensors, and matrices where rows*cols <= min_compression_rate * (rows+cols) * r), the
  same rule as torch's powerSGD_hook.

Usage::

    python -m experiments.ddp_hooks_bench                 # writes experiments/results/ddp_hooks_cpu_<date>.*
    python -m experiments.ddp_hooks_bench --quick         # a short smoke run, nothing written
    python -m experiments.ddp_hooks_bench --only ours-powersgd-r1,torch-powersgd-r1 --profile
"""
import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from experiments import baselines
from experiments.launch import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PSGD = baselines.PSGD

# (name, kind, options); kind: "ddp", "torch-fp16", "torch-powersgd", or a gradcomp compressor
CONFIGS = [
    ("ddp", "ddp", {}),
    # the compute floor: DDP with a hook that returns each bucket untouched (no communication);
    # what a perfect compressor would approach
    ("no-comm", "no-comm", {}),
    # the compute floor plus one 1-element allreduce per bucket: the floor of any synchronous
    # hook (the step then waits for the slowest rank; on shared cores that is the skew)
    ("sync-floor", "sync-floor", {}),
    ("ours-allreduce", "allreduce", {}),
    ("torch-fp16", "torch-fp16", {}),
    # DDP's average through PyTorch's allreduce_hook: what registering any hook costs on its own
    ("torch-allreduce", "torch-allreduce", {}),
    ("ours-fp16", "fp16", {}),
    ("torch-powersgd-r1", "torch-powersgd", {"rank": 1}),
    ("ours-powersgd-r1", "powersgd", {"rank": 1, **PSGD}),
    ("ours-powersgd-r1-nocheck", "powersgd", {"rank": 1, "check_finite": False, **PSGD}),
    ("torch-powersgd-r4", "torch-powersgd", {"rank": 4}),
    ("ours-powersgd-r4", "powersgd", {"rank": 4, **PSGD}),
    ("ours-topk-0.001", "topk", {"ratio": 0.001}),
    ("ours-topk-0.01", "topk", {"ratio": 0.01}),
    # top-k with the size allgather before every payload allgather (the exchange before
    # "auto"/"bound" padded payloads to the step's bound and dropped it): the A/B of that round
    ("ours-topk-0.001-sizes", "topk", {"ratio": 0.001, "exchange": "sizes"}),
    ("ours-topk-0.01-sizes", "topk", {"ratio": 0.01, "exchange": "sizes"}),
    ("ours-randomk-0.01", "randomk", {"ratio": 0.01}),
    ("ours-onebit", "onebit", {}),
    # the 1-bit plan without the block rotation (the accuracy fix): what the rotation costs
    ("ours-onebit-norotate", "onebit", {"rotate": False}),
    # the same hooks without pipelining (each bucket's phases strictly after the previous
    # bucket's): the A/B of the worker's overlap of compression with transfers
    ("ours-fp16-serial", "fp16", {"pipeline": False}),
    ("ours-powersgd-r4-serial", "powersgd", {"rank": 4, "pipeline": False, **PSGD}),
    ("ours-topk-0.001-serial", "topk", {"ratio": 0.001, "pipeline": False}),
    ("ours-onebit-serial", "onebit", {"pipeline": False}),
    # measures allreduce / fp16 / powersgd r4 on the real link, then picks per bucket; its trial
    # (start_iter 2 + 3 candidates x trial_steps) must end within the warm-up: --warmup >= 9
    # (>= 11 for ours-auto-topk's four candidates)
    ("ours-auto", "auto", {"trial_steps": 2}),
    # the same with top-k (0.1%) allowed (its accuracy needs DGC momentum correction)
    ("ours-auto-topk", "auto", {"trial_steps": 2, "max_density": 0.001,
                                "candidates": ["allreduce", "fp16", "powersgd", "topk"]}),
    ("ours-quant-4", "quant", {"bits": 4}),
    # two-level plans (with --per-node): full precision inside a node, the family across nodes
    ("ours-allreduce-hier", "allreduce", {"hierarchy": "node"}),
    ("ours-fp16-hier", "fp16", {"hierarchy": "node"}),
    ("ours-topk-0.001-hier", "topk", {"ratio": 0.001, "hierarchy": "node"}),
    ("ours-topk-0.01-hier", "topk", {"ratio": 0.01, "hierarchy": "node"}),
    ("ours-randomk-0.01-hier", "randomk", {"ratio": 0.01, "hierarchy": "node"}),
    ("ours-onebit-hier", "onebit", {"hierarchy": "node"}),
    ("ours-quant-4-hier", "quant", {"bits": 4, "hierarchy": "node"}),
    ("ours-powersgd-r4-hier", "powersgd", {"rank": 4, "hierarchy": "node", **PSGD}),
]

# --set sweep (experiments/auto_sweep.py): what a user would compare before adding one line:
# plain DDP, PyTorch's two hooks at the settings a user would pick (fp16; PowerSGD at its
# default rank 1, from the second step), auto with its defaults, and every compressing family
# of ours at its documented defaults (nothing tuned); no-comm gives the compute floor, from
# which plain DDP's share of the step spent communicating follows
SWEEP_CONFIGS = [
    ("ddp", "ddp", {}),
    ("no-comm", "no-comm", {}),
    ("torch-fp16", "torch-fp16", {}),
    ("torch-powersgd", "torch-powersgd", {"rank": 1}),
    ("auto", "auto", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("quant", "quant", {}),
    ("powersgd", "powersgd", {}),
    ("topk", "topk", {}),
    ("randomk", "randomk", {}),
    ("onebit", "onebit", {}),
    ("fp8", "fp8", {}),
    # not in the sweep's own list (experiments.auto_sweep.METHODS): A/Bs of auto's mechanism, run
    # with --only (auto_sweep --methods): its decision without the step rule (step_margin 0, the
    # rule before it), and fp8 among its candidates; quant by each of its routes (its default
    # takes the gather route on 2 ranks, the two phases on more); auto without fp16's ring route
    ("auto-step0", "auto", {"step_margin": 0.0}),
    ("auto-fp8", "auto", {"candidates": ["allreduce", "fp16", "fp8", "quant", "powersgd"]}),
    ("quant-2phase", "quant", {"route": "two_phase"}),
    ("quant-gather", "quant", {"route": "gather"}),
    # auto without fp16's ring route among its candidates (the candidate list before it)
    ("auto-noring", "auto", {"_without_ring": True}),
    # auto with the earlier cost across ranks (the mean of the ranks' medians, each rank's time
    # including its wait for later ranks) instead of each step's least over the ranks
    ("auto-meancost", "auto", {"_mean_cost": True}),
    # every small allreduce through gloo's ring (2 (P - 1) rounds) instead of one allgather and a
    # rank-ordered sum (gradcomp.torch._driver.P2P_ALLREDUCE_BYTES): auto, and PowerSGD alone
    ("auto-ringsums", "auto", {"_ring_sums": True}),
    ("powersgd-ringsums", "powersgd", {"_ring_sums": True}),
    # auto with step_margin a share of the whole trial's median step (every candidate's steps,
    # plain DDP's included) instead of the fastest candidate's step
    ("auto-trialstep", "auto", {"_trial_step": True}),
    # auto with 2 measured steps a candidate (trial_steps 3) instead of 3: the default before
    ("auto-trial3", "auto", {"trial_steps": 3}),
]




class Net(torch.nn.Module):
    """`layers` Linear(width, width) layers with ReLU between them."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for i, l in enumerate(self.layers):
            x = l(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def _make_net(args):
    """The benchmark's model and one rank's batch: "mlp" (Net(width, layers), MSE on random
    targets) or the Fashion-MNIST experiment's "cnn" / "vit" (random 28 x 28 images, cross
    entropy on random labels: a step's cost does not depend on the pixels)."""
    if args.model == "mlp":
        return Net(args.width, args.layers)
    from experiments.train import make_model
    return make_model(args.model)


def _batch(args, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    if args.model == "mlp":
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randn(args.batch, args.width, generator=gen)
        return x, y, torch.nn.functional.mse_loss
    x = torch.randn(args.batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    return x, y, torch.nn.functional.cross_entropy


def _p2p_allreduce_default() -> int:
    try:
        from gradcomp.torch import _driver
    except ImportError:  # (gradcomp not installed: the bench's own tests of its parts)
        return 0
    return _driver.P2P_ALLREDUCE_BYTES


_P2P_ALLREDUCE_BYTES = _p2p_allreduce_default()


def _setup(kind, opts, model, per_node=1):
    """Registers the hook of one configuration; returns the gradcomp state or None."""
    from gradcomp.torch import _driver
    # (a module setting, read when a collective is launched: each configuration sets it, since
    # they run one after another in the same processes)
    _driver.P2P_ALLREDUCE_BYTES = 0 if opts.get("_ring_sums") else _P2P_ALLREDUCE_BYTES
    if kind == "ddp":
        return None
    if kind in baselines.KINDS:
        baselines.register(kind, model, opts)
        return None
    import gradcomp.torch as gt
    from gradcomp.torch import _auto
    o = dict(opts)
    o.pop("_ring_sums", None)
    without_ring = o.pop("_without_ring", False)  # the A/B of fp16's ring route in auto
    mean_cost = o.pop("_mean_cost", False)  # the A/B of auto's cost across ranks
    trial_step = o.pop("_trial_step", False)  # the A/B of step_margin's step
    if o.get("hierarchy"):
        o.setdefault("per_node", per_node)
    ring = _auto._RING_ROUTED
    _auto._RING_ROUTED = () if without_ring else ring  # (read when the candidates are listed)
    try:
        state, hook = gt.hook(kind, model=model, **o)
    finally:
        _auto._RING_ROUTED = ring
    if mean_cost:
        state._skew_free = False
    if trial_step:
        state._fastest_step = False
    model.register_comm_hook(state, hook)
    return state


def _worker(rank, world, init, args, out):
    """One rank: `init` a port on 127.0.0.1 or a tcp:// address; rank 0 puts the rows on `out`
    (a queue, or a JSON file's path in --netns mode)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if isinstance(init, int):
        init = f"tcp://127.0.0.1:{init}"
    from experiments import latency

    # --delay: gloo with that one-way latency per message round (experiments.latency)
    backend = latency.backend_for(args.delay, per_node=args.per_node)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    configs = SWEEP_CONFIGS if args.set == "sweep" else CONFIGS
    names = [c[0] for c in configs]
    chosen = [c for c in configs if not args.only or c[0] in args.only.split(",")]
    order = []
    for rnd in range(args.rounds):
        order += [(rnd, c) for c in (chosen if rnd % 2 == 0 else chosen[::-1])]
    x, y, loss_fn = _batch(args, rank)
    results = {}
    for rnd, (name, kind, opts) in order:
        torch.manual_seed(0)
        model = DDP(_make_net(args), bucket_cap_mb=args.bucket_cap_mb)
        state = _setup(kind, opts, model, args.per_node)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        n_params = sum(p.numel() for p in model.parameters())
        # auto's trial (start_iter + candidates x trial_steps) must end inside the warm-up
        warm = args.warmup
        if kind == "auto":
            trial = state.start_iter + len(state.candidates) * state.trial_steps + 1
            warm = max(warm, trial if args.warmup_auto is None else args.warmup_auto)
        times = []
        prof = None
        dist.barrier()
        for step in range(warm + args.steps):
            if args.profile and step == warm and rank == 0:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
            import pstats
            print(f"\n== profile rank 0, {name} ==", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step: the slowest rank
        step_times = t.tolist()[warm:]
        hist = None
        choices = None
        trial = None
        if kind == "auto":  # (ours-auto, ours-auto-topk)
            choices = dict(state.choices)
            assert state.trials and state.trials[-1]["iter"] <= warm, \
                "auto: the trial did not end within the warm-up; raise --warmup-auto"
            # what the trial measured, beside what its steps took: each candidate's consensus
            # cost per bucket, and every warm-up step's time (the slowest rank's) with the
            # candidate that ran it, so a choice the timed steps contradict can be traced
            last = state.trials[-1]
            trial = {"choices": {str(i): c for i, c in last["choices"].items()},
                     "costs": {str(i): c for i, c in last["costs"].items()},
                     "step_seconds": last["step_seconds"], "iter": last["iter"],
                     "candidate_step_seconds": last.get("candidate_step_seconds"),
                     "warm_steps": [[state.phase(i)[1], s] for i, s in
                                    enumerate(t.tolist()[:warm])]}
        tl = None
        if state is not None:  # the last timed step's timeline (rank 0's clock)
            import gradcomp.torch as gt
            tl = gt.timeline(state)
        if state is not None:
            hs = [h for h in state.history if h["iter"] >= warm]
            hs = [h for h in hs if h["iter"] < warm + args.steps]
            hist = {
                "bytes": statistics.mean(h["bytes_sent"] for h in hs),
                "wire": statistics.mean(h["wire_bytes"] for h in hs),
                "cross": statistics.mean(h.get("cross_wire_bytes", h["wire_bytes"]) for h in hs),
                "dense": statistics.mean(h["dense_bytes"] for h in hs),
                "local_s": statistics.mean(h["local_seconds"] for h in hs),
            }
            if state._worker is not None:
                state._worker.close()
        if kind == "ddp" or kind in baselines.KINDS:
            nbytes, source = baselines.bytes_per_step(kind, model.module, opts), "analytic"
        else:
            nbytes = hist["bytes"]
            source = "measured"
        # bytes on one rank's link: the analytic configurations are ring allreduces
        wire = hist["wire"] if source == "measured" else 2 * (world - 1) * nbytes / world
        # bytes this rank sends over the network between nodes: a hierarchical plan's
        # cross-node collectives (its inside-node ones stay on the node)
        cross = hist["cross"] if source == "measured" else wire
        med = statistics.median(step_times)
        mean = statistics.mean(step_times)
        prev = results.get(name)
        if prev is None or med < prev["median_s"]:
            results[name] = {"name": name, "median_s": med, "mean_s": mean, "min_s": min(step_times),
                             "bytes": nbytes, "wire": wire, "cross": cross,
                             "bytes_source": source,
                             "params": n_params,
                             "local_s": hist["local_s"] if hist else None, "round": rnd,
                             "choices": choices, "trial": trial, "timeline": tl,
                             "all_rounds": (prev["all_rounds"] if prev else []) + [med],
                             # every round's own trial and choice (auto decides anew each round)
                             "all_trials": (prev["all_trials"] if prev else []) + [trial]}
        else:
            prev["all_rounds"].append(med)
            prev["all_trials"].append(trial)
        if rank == 0:
            print(f"  [{rnd}] {name:20s} median {1e3 * med:8.1f} ms  mean {1e3 * mean:8.1f} ms"
                  f"  bytes/step {nbytes:,.0f}"
                  + (f"  hook local {1e3 * hist['local_s']:.1f} ms" if hist else "")
                  + (f"  chose {choices}" if choices is not None else ""), flush=True)
        del model, opt, state
    dist.barrier()
    if rank == 0:
        rows = [results[n] for n in names if n in results]
        if isinstance(out, str):
            with open(out, "w") as f:
                json.dump(rows, f)
        else:
            out.put(rows)
    dist.destroy_process_group()


class LoadSampler(threading.Thread):
    """Samples the 1-minute load average every few seconds while the benchmark runs."""

    def __init__(self, every=5.0):
        super().__init__(daemon=True)
        self.every, self.samples, self._halt = every, [], threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.samples.append(os.getloadavg()[0])
            self._halt.wait(self.every)

    def stop(self):
        self._halt.set()
        self.join()


def _git(*a):
    try:
        return subprocess.check_output(["git", *a], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def _fmt_bytes(b):
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def _table(rows):
    by = {r["name"]: r for r in rows}
    base = by.get("ddp")
    floor = by.get("no-comm")
    sync = by.get("sync-floor")
    out = []
    hdr = ("config", "steps/s", "ms/step (median)", "ms/step (mean)",
           "ms/step (median of rounds)", "vs plain DDP",
           "over compute floor", "over sync floor",
           "bytes/step", "wire bytes/step", "between nodes", "bytes source",
           "vs PyTorch counterpart", "hierarchical vs flat", "hook local ms/step")
    out.append(hdr)
    counterpart = {"ours-allreduce": "ddp", "ours-fp16": "torch-fp16",
                   "ours-powersgd-r1": "torch-powersgd-r1",
                  "ours-powersgd-r1-nocheck": "torch-powersgd-r1", "ours-powersgd-r4": "torch-powersgd-r4"}
    for r in rows:
        sps = 1.0 / r["median_s"]
        vs = f"{base['median_s'] / r['median_s']:.2f}x" if base else "-"
        c = by.get(counterpart.get(r["name"], ""))
        vc = f"{c['median_s'] / r['median_s']:.2f}x vs {c['name']}" if c else "-"
        loc = f"{1e3 * r['local_s']:.1f}" if r["local_s"] is not None else "-"
        over = f"{100 * (r['median_s'] / floor['median_s'] - 1):+.0f}%" if floor else "-"
        over_sync = f"{100 * (r['median_s'] / sync['median_s'] - 1):+.0f}%" if sync else "-"
        flat = by.get(r["name"][:-len("-hier")]) if r["name"].endswith("-hier") else None
        vf = f"{flat['median_s'] / r['median_s']:.2f}x vs {flat['name']}" if flat else "-"
        cross = _fmt_bytes(r["cross"]) if r["name"].endswith("-hier") else "-"
        out.append((r["name"], f"{sps:.2f}", f"{1e3 * r['median_s']:.1f}",
                    f"{1e3 * r['mean_s']:.1f}", f"{1e3 * statistics.median(r['all_rounds']):.1f}",
                    vs, over, over_sync, _fmt_bytes(r["bytes"]), _fmt_bytes(r["wire"]), cross,
                    r["bytes_source"], vc, vf, loc))
    return out


def _run_in_namespaces(args):
    """Starts every rank inside its own namespace (experiments.netem), rank 0 at
    10.77.0.1; bounded by --timeout; the namespaces are removed whatever happens."""
    import tempfile
    from experiments import netem
    result = os.path.join(tempfile.mkdtemp(), "rows.json")
    passthrough = [a for a in sys.argv[1:]]
    i = 0
    while i < len(passthrough):  # drop --netns (and its value) from the ranks' argv
        if passthrough[i] == "--netns":
            del passthrough[i:i + 2]
        elif passthrough[i].startswith("--netns="):
            del passthrough[i]
        else:
            i += 1
    netem.run_in_namespaces(
        args.world, args.netns,
        lambda r: [sys.executable, "-m", "experiments.ddp_hooks_bench", *passthrough,
                   "--_rank", str(r), "--_init", f"tcp://{netem.RANK0_ADDR}:29517",
                   "--_result", result],
        timeout=args.timeout, per_node=args.per_node)
    with open(result) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--model", choices=("mlp", "cnn", "vit"), default="mlp",
                    help="mlp: --layers x Linear(--width, --width); cnn, vit: the Fashion-MNIST "
                         "experiment's models on random 28 x 28 images")
    ap.add_argument("--set", choices=("bench", "sweep"), default="bench",
                    help="the configurations: this benchmark's A/B list, or the sweep's "
                         "(experiments/auto_sweep.py: every method at its defaults)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--warmup-auto", type=int, default=None,
                    help="warm-up steps of the auto configurations (default: their trial, "
                         "start_iter + candidates x trial_steps, and one step more); the trial "
                         "must end inside it")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=1024.0,
                    help="DDP bucket cap; the default puts the model in one bucket, so that "
                         "waiting for torch's powerSGD_hook inside the hook costs no overlap")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's timed steps")
    ap.add_argument("--timeline", action="store_true",
                    help="write each gradcomp configuration's last-step timeline (text in the .md, "
                         "and a _timeline.png)")
    ap.add_argument("--quick", action="store_true", help="small smoke run; writes nothing")
    ap.add_argument("--netns", default="", metavar="RATE",
                    help="root: every rank in its own network namespace, links limited to RATE "
                         "(tc syntax, e.g. 1gbit, 10gbit) both ways (experiments.netem); "
                         "default: all ranks on loopback")
    ap.add_argument("--delay", default="",
                    help="one-way latency added to every collective per message round (e.g. "
                         "5ms; experiments.latency, torch 2.x); with --per-node, not "
                         "to groups inside one node")
    ap.add_argument("--per-node", type=int, default=1,
                    help="ranks per node: with --netns, a two-level cluster (a namespace per node, "
                         "its ranks unshaped among themselves, nodes joined by RATE links); the "
                         "*-hier configurations use it as their node size")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds: process-group timeout, and the bound on a --netns run")
    ap.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--json", default="",
                    help="write the rows and the run's context to this JSON file instead of the "
                         ".md/.csv pair (experiments/auto_sweep.py)")
    args = ap.parse_args()
    if args.quick:
        args.width, args.layers, args.warmup, args.steps, args.rounds = 256, 3, 11, 3, 1
    if args._rank is not None:  # one rank of a --netns run, started inside its namespace
        _worker(args._rank, args.world, args._init, args, args._result)
        return

    # one OpenMP thread per rank everywhere, also in threads the ranks start later (gloo's
    # callback threads run PyTorch's hook continuations; a new thread starts from this default)
    os.environ["OMP_NUM_THREADS"] = "1"
    load_before = os.getloadavg()
    sampler = LoadSampler()
    sampler.start()
    t0 = time.time()
    if args.netns:
        rows = _run_in_namespaces(args)
    else:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.spawn(_worker, args=(args.world, free_port(), args, q), nprocs=args.world, join=True)
        rows = q.get()
    wall = time.time() - t0
    sampler.stop()
    load = sampler.samples or [os.getloadavg()[0]]

    table = _table(rows)
    widths = [max(len(str(r[i])) for r in table) for i in range(len(table[0]))]
    for j, r in enumerate(table):
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print(f"wall {wall:.0f} s; load average (1 min) during the run: min {min(load):.2f}, "
          f"mean {statistics.mean(load):.2f}, max {max(load):.2f}")
    if args.quick:
        return
    if args.json:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": _git("rev-parse", "--short", "HEAD"),
                "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
                "command": "python -m experiments.ddp_hooks_bench " + " ".join(sys.argv[1:]),
                "torch": torch.__version__, "cpus": os.cpu_count(), "wall_s": wall,
                "load_before": load_before[0], "load_min": min(load),
                "load_mean": statistics.mean(load), "load_max": max(load)}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
        os.replace(tmp, args.json)  # a half-written file never looks like a finished setting
        print(f"wrote {args.json}")
        return

    date = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    where = f"netns_{args.netns}" if args.netns else "cpu"
    if args.per_node > 1:
        where += f"_{args.world // args.per_node}x{args.per_node}"
    stem = os.path.join(args.out, f"ddp_hooks_{where}_{date}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "steps_per_s", "median_ms", "mean_ms", "min_ms", "bytes_per_step",
                    "wire_bytes_per_step", "cross_node_wire_bytes_per_step", "bytes_source",
                    "hook_local_ms", "rounds_median_ms"])
        for r in rows:
            w.writerow([r["name"], f"{1 / r['median_s']:.4f}", f"{1e3 * r['median_s']:.2f}",
                        f"{1e3 * r['mean_s']:.2f}", f"{1e3 * r['min_s']:.2f}", f"{r['bytes']:.0f}",
                        f"{r['wire']:.0f}", f"{r['cross']:.0f}", r["bytes_source"],
                        "" if r["local_s"] is None else f"{1e3 * r['local_s']:.2f}",
                        " ".join(f"{1e3 * m:.1f}" for m in r["all_rounds"])])
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    n_params = rows[0]["params"]
    with open(stem + ".md", "w") as f:
        link = (f"each rank in its own network namespace, links {args.netns} each way"
                + (f", delay {args.delay}" if args.delay else "") if args.netns else "loopback")
        if args.netns and args.per_node > 1:
            link = (f"{args.world // args.per_node} nodes x {args.per_node} ranks: a network "
                    f"namespace per node, its ranks unshaped among themselves (loopback), one "
                    f"link of {args.netns} each way per node"
                    + (f", delay {args.delay}" if args.delay else ""))
        f.write(f"# DDP communication hooks, {args.world} CPU ranks (gloo, {link})\n\n")
        f.write(f"- Date: {date}. Code: commit {commit}{dirty} (branch {_git('rev-parse', '--abbrev-ref', 'HEAD')}). "
                f"torch {torch.__version__}, Python {platform.python_version()}.\n")
        f.write(f"- Machine: {os.cpu_count()}-core VM ({platform.processor() or platform.machine()}), "
                f"shared with other jobs; 1-minute load average during the run: min {min(load):.2f}, "
                f"mean {statistics.mean(load):.2f}, max {max(load):.2f} (before: "
                f"{load_before[0]:.2f}). {args.world} ranks, 1 intra-op thread each, so they "
                f"oversubscribe the cores.\n")
        what = (f"{args.layers} x Linear({args.width}, {args.width}) with ReLU" if args.model == "mlp"
                else f"the Fashion-MNIST experiment's {args.model} on random 28 x 28 images")
        f.write(f"- Model: {what}, "
                f"{n_params:,} parameters ({n_params * 4 / 1e6:.0f} MB fp32 gradient), batch "
                f"{args.batch} per rank, {'MSE' if args.model == 'mlp' else 'cross-entropy'} "
                f"loss, SGD lr 1e-3; DDP bucket_cap_mb "
                f"{args.bucket_cap_mb:g}"
                + " (DDP closes its first bucket once it holds 1 MB, the others at the cap; the "
                "hooks' bucket indices show how many)"
                + ". torch's powerSGD_hook is waited for inside the hook: unwaited, torch 1.13 + "
                "gloo aborted (gloo size mismatch) or hung on this model, as it issues its P and "
                "Q allreduces from gloo's completion threads.\n")
        f.write(f"- Per configuration: {args.warmup} warm-up steps, then {args.steps} timed steps; "
                f"{args.rounds} rounds (odd rounds in reverse order), the best round kept (the "
                "median of the round medians beside it: the steadier figure for configurations "
                "within a few percent of each other). Step time "
                f"= slowest rank; steps/s = 1 / median step time. Wall time {wall:.0f} s.\n")
        f.write("- PowerSGD (both): start iteration 2, warm start, error feedback, "
                "min_compression_rate 2. Bytes/step: bytes one rank hands to collectives per step; wire "
                "bytes/step: bytes it puts on its link (ring allreduce 2(P-1)/P of its buffer, "
                "all-to-all (P-1)/P, ring allgather P-1 parts); "
                "ours measured from `state.history`, plain DDP and PyTorch's hooks computed "
                "(\"analytic\": n*4, n*2, sum (rows+cols)*r*4 + 4 * uncompressed elements). "
                "Between nodes: the wire bytes of a hierarchical plan's (-hier) cross-node "
                "collectives, measured; its inside-node reduce-scatter and allgather stay on the "
                "node.\n")
        f.write(f"- Command: `python -m experiments.ddp_hooks_bench {' '.join(sys.argv[1:])}`\n\n")
        f.write("| " + " | ".join(table[0]) + " |\n")
        f.write("|" + "---|" * len(table[0]) + "\n")
        for r in table[1:]:
            f.write("| " + " | ".join(r) + " |\n")
        if args.timeline:
            f.write("\nTimeline of the last timed step, rank 0, per bucket (the hook's own records, "
                    "`gradcomp.torch.timeline`; ms from the first bucket handed to the worker); "
                    f"plot: `{os.path.basename(stem)}_timeline.png`:\n\n")
            for r in rows:
                if r.get("timeline"):
                    import gradcomp.torch as gt
                    f.write(f"{r['name']}:\n```\n{gt.format_timeline(r['timeline'])}\n```\n")
        for r in rows:
            if r.get("choices") is not None:
                f.write(f"\n{r['name']} chose per DDP bucket (index: compressor): "
                        + ", ".join(f"{i}: {c}" for i, c in sorted(r["choices"].items()))
                        + " (the kept round's decision).\n")
        f.write("\nMedian ms/step of each round: "
                + "; ".join(f"{r['name']} {' / '.join(f'{1e3 * m:.0f}' for m in r['all_rounds'])}"
                            for r in rows) + "\n")
    if args.timeline:
        _plot_timeline(rows, stem + "_timeline.png", link)
    print(f"wrote {stem}.md and {stem}.csv")


def _plot_timeline(rows, path, link):
    """One panel per gradcomp configuration: a bar per bucket from queued to done, colored by
    phase (begin and local work, each collective, the wait in the worker's queue)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.2 + 0.9 * len(rows)), sharex=True,
                             squeeze=False)
    colors = {"local": "tab:orange", "begin": "tab:red", "queued": "lightgrey"}
    seen = set()
    for ax, r in zip(axes[:, 0], rows):
        for y, b in enumerate(r["timeline"]):
            spans = [("queued", b["queued_ms"], b["started_ms"])] + list(b["phases"])
            for what, a, e in spans:
                kind = what if what in colors else "collective"
                c = colors.get(kind, "tab:blue")
                ax.barh(y, max(e - a, 0.05), left=a, color=c, edgecolor="none",
                        label=kind if kind not in seen else None)
                seen.add(kind)
        ax.set_yticks(range(len(r["timeline"])))
        ax.set_yticklabels([f"bucket {b['bucket']} ({b['compressor']})" for b in r["timeline"]],
                           fontsize=7)
        ax.set_title(f"{r['name']}: step {1e3 * r['median_s']:.0f} ms (median)", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the first bucket handed to the hook's worker (rank 0)")
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Where each bucket's communication time goes ({link})", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
