# SPDX-License-Identifier: Apache-2.0
"""Fashion-MNIST training with DDP and gradcomp hooks: accuracy of each compressor against plain
DDP at the same learning rate, on N gloo ranks (loopback).

Data: Debian's ``dataset-fashion-mnist`` package (IDX files under
``/usr/share/datasets/fashion-mnist/``, or ``$GRADCOMP_FASHION_MNIST``). Nothing is downloaded.

Run (4 ranks, one epoch, every configuration, two seeds)::

    python -m gradcomp.experiments.fashion_mnist --configs plain,onebit --seeds 0,1

Each configuration runs in fresh processes with the same seed, initial weights and data order;
rank r trains on shard r of each epoch's permutation (``batch`` samples per rank per step).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import socket
import struct
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---- data ----------------------------------------------------------------------------------------
def _open(path: str):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            return gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
    raise FileNotFoundError(
        f"Fashion-MNIST file {path}[.gz] not found: install Debian's package "
        f"'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist) or set "
        f"GRADCOMP_FASHION_MNIST to a folder holding the IDX files")


def load_idx(path: str) -> np.ndarray:
    """Reads an IDX file (uint8 data; magic 0x00000801 for labels, 0x00000803 for images).
    Raises ValueError on a wrong magic, a wrong type, or a size that does not match the header
    (truncated or padded file)."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    if ndim < 1 or ndim > 4 or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: IDX header announces {ndim} dimensions")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    want = 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64))
    if len(raw) != want:
        raise ValueError(f"{path}: {len(raw)} bytes, the header {dims} needs {want} "
                         f"(truncated or corrupt file)")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(split: str, root: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, 1, 28, 28] normalised, labels int64 [N]) of 'train' or 'test'."""
    root = root or os.environ.get("GRADCOMP_FASHION_MNIST", DEFAULT_DIR)
    img_f, lab_f = _FILES[split]
    images = load_idx(os.path.join(root, img_f))
    labels = load_idx(os.path.join(root, lab_f))
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"{split} images have shape {images.shape}, expected [N, 28, 28]")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{split}: {images.shape[0]} images but labels of shape {labels.shape}")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{split}: label {int(labels.max())} outside 0..9")
    x = (images.astype(np.float32) / 255.0 - 0.2860) / 0.3530
    return x[:, None, :, :], labels.astype(np.int64)


# ---- model ---------------------------------------------------------------------------------------
def make_model(kind: str = "cnn"):
    """'cnn': two 3x3 conv layers (32, 64 channels, each followed by 2x2 max pooling), then
    3136 -> 256 -> 10 (824k parameters). 'wide': the same with a 3136 -> 2048 -> 10 head (6.5M),
    a communication-bound variant. 'wide4096': a 3136 -> 4096 -> 10 head (12.9M), whose
    classifier (40,960 weights) is above random-k's default dense_below (32768), as an ImageNet
    classifier is."""
    import torch.nn as nn

    hidden = {"cnn": 256, "wide": 2048, "wide4096": 4096}[kind]
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10))


# ---- configurations --------------------------------------------------------------------------
#: DGC's sparsity warm-up (density 25%, 6.25%, 1.56%, 0.4%, then the target), one stage per
#: DGC_WARMUP_STEPS steps: the paper warms up over its first 4 of 90 epochs (4.4% of training);
#: here 4 stages of 10 steps, 8.5% of one epoch
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
DGC_WARMUP_STEPS = 10

# name -> (gradcomp hook, PyTorch baseline (gradcomp.experiments.baselines) or None for plain
# DDP; hook options; whether the hook applies the momentum, i.e. dgc_optimizer: plain SGD)
CONFIGS: Dict[str, Tuple[Optional[str], Dict[str, Any], bool]] = {
    "plain": (None, {}, False),
    "torch-fp16": ("torch-fp16", {}, False),
    "torch-powersgd": ("torch-powersgd", dict(rank=4), False),
    "fp16": ("fp16", {}, False),
    "bf16": ("bf16", {}, False),
    "topk": ("topk", dict(ratio=0.001, momentum=0.9), True),
    "topk-dgc": ("topk", dict(ratio=0.001, momentum=0.9, warmup_ratios=DGC_WARMUP,
                              warmup_steps=DGC_WARMUP_STEPS), True),
    "randomk": ("randomk", dict(ratio=0.01), False),
    "randomk-mc": ("randomk", dict(ratio=0.01, momentum=0.9), True),
    "randomk10": ("randomk", dict(ratio=0.1), False),
    "randomk10-mc": ("randomk", dict(ratio=0.1, momentum=0.9), True),
    "onebit": ("onebit", {}, False),
    "onebit-mc": ("onebit", dict(momentum=0.9), True),
    "powersgd": ("powersgd", dict(rank=4), False),
}
#: suffixes a configuration may carry: "+slow" injects log-normal delays on the last rank and
#: trains with micro-batches; "+dropcompute" adds DropCompute (automatic tau) to that loop
FLAGS = ("slow", "dropcompute")


def parse_config(spec: str) -> Tuple[str, Optional[str], Dict[str, Any], bool]:
    """'name' from CONFIGS, or 'hook:key=value;...' (values parsed as JSON, else strings), e.g.
    'onebit:block_size=0;rotate=false', optionally followed by '+slow' and '+dropcompute' (see FLAGS, read by
    config_flags). A hook option 'momentum' makes the hook apply momentum (plain SGD then)."""
    spec = spec.split("+", 1)[0]
    if spec in CONFIGS:
        h, o, mc = CONFIGS[spec]
        return spec, h, dict(o), mc
    if ":" not in spec:
        raise ValueError(f"unknown configuration {spec!r}; known: {sorted(CONFIGS)} or hook:opts")
    h, rest = spec.split(":", 1)
    opts: Dict[str, Any] = {}
    for kv in filter(None, rest.split(";")):
        k, v = kv.split("=", 1)
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return spec, (None if h == "plain" else h), opts, bool(opts.get("momentum", 0.0))


def config_flags(spec: str) -> Tuple[str, ...]:
    flags = tuple(spec.split("+")[1:])
    bad = [f for f in flags if f not in FLAGS]
    if bad:
        raise ValueError(f"{spec!r}: unknown suffix {bad}; known: {', '.join(FLAGS)}")
    if "dropcompute" in flags and "slow" not in flags:
        raise ValueError(f"{spec!r}: +dropcompute is measured against the same run with +slow; "
                         "write '+slow+dropcompute'")
    return flags


# ---- one rank ------------------------------------------------------------------------------------
def _evaluate(model, x, y, batch=2000) -> float:
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / max(1, len(x))


class _Diag:
    """Per-layer diagnostics: the mean |local gradient| of each parameter (captured by a tensor
    hook before DDP's reducer sees it) and the mean |averaged gradient| the comm hook returned.
    Their ratio is the step size each layer effectively gets relative to its own gradient (1 for
    plain DDP up to the spread between ranks)."""

    def __init__(self, model, names):
        self.names = names
        self.params = list(model.parameters())
        self.local: Dict[str, float] = {}
        for n, p in zip(names, self.params):
            p.register_hook(lambda g, n=n: self._capture(n, g))

    def _capture(self, name, g):
        self.local[name] = float(g.abs().mean())
        return g

    def record(self) -> Dict[str, Any]:
        out = {}
        for n, p in zip(self.names, self.params):
            if p.grad is None:
                continue
            avg = float(p.grad.abs().mean())
            loc = self.local.get(n, float("nan"))
            out[n] = {"local_mean_abs": loc, "avg_mean_abs": avg,
                      "ratio": avg / loc if loc > 0 else float("nan")}
        return out


def _slow_delays(seed: int, step: int, m: int, a: Dict[str, Any]) -> np.ndarray:
    """The slow rank's added delay (seconds) for each of the m micro-batches of `step`: a base
    latency plus a bounded log-normal noise (DropCompute's delay environment), drawn from a
    stream keyed by (seed, step): the run with DropCompute and the one without draw the same."""
    r = np.random.default_rng([seed, 7919, step])
    noise = np.minimum(np.exp(r.normal(a["slow_log_mu"], a["slow_log_sigma"], m)), a["slow_cap_ms"])
    return (a["slow_base_ms"] + noise) / 1e3


def train_rank(rank: int, world: int, args: Dict[str, Any], out_path: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    _, hook_name, opts, hook_momentum = parse_config(args["config"])
    flags = config_flags(args["config"])
    xtr, ytr = load_split("train", args.get("data"))
    xte, yte = load_split("test", args.get("data"))
    if args.get("train_subset"):
        xtr, ytr = xtr[:args["train_subset"]], ytr[:args["train_subset"]]
    if args.get("test_subset"):
        xte, yte = xte[:args["test_subset"]], yte[:args["test_subset"]]
    xtr, ytr = torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(ytr)
    xte, yte = torch.from_numpy(np.ascontiguousarray(xte)), torch.from_numpy(yte)

    seed = int(args["seed"])
    torch.manual_seed(seed)
    net = make_model(args.get("model", "cnn"))
    names = [n for n, _ in net.named_parameters()]
    model = DDP(net)
    diag = _Diag(net, names) if args.get("diag") else None
    state = None
    from gradcomp.experiments import baselines

    if hook_name in baselines.KINDS:
        baselines.register(hook_name, model, opts)
    elif hook_name is not None:
        import gradcomp.torch as gt

        state, hook = gt.hook(hook_name, model=model, **opts)
        model.register_comm_hook(state, hook)
    lr = float(args["lr"])
    mom = float(args["momentum"])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0 if hook_momentum else mom,
                          weight_decay=float(args.get("weight_decay", 0.0)))
    batch = int(args["batch"])
    per_step = batch * world
    steps_per_epoch = len(xtr) // per_step
    max_steps = int(args.get("steps") or 0)
    log_every = int(args.get("log_every", 25))
    eval_every = int(args.get("eval_every") or 0)

    # micro-batches: with a slow rank (its delays after each micro-batch) and DropCompute
    M = int(args.get("micro_batches", 4)) if "slow" in flags else 1
    if batch % M:
        raise ValueError(f"batch {batch} is not a multiple of micro_batches {M}")
    slow = "slow" in flags and rank == world - 1
    dc = None
    if "dropcompute" in flags:
        from gradcomp.torch.dropcompute import DropCompute

        dc = DropCompute(model, M, tau=None, warmup_steps=int(args.get("dc_warmup", 5)))
    # bytes a ring allreduce moves per step without a gradcomp hook (analytic)
    plain_bytes = baselines.bytes_per_step(hook_name or "ddp", net, opts) if state is None else 0
    # bytes on one rank's link per step when a ring allreduce moves `b` bytes
    ring_wire = lambda b: 2 * (world - 1) * b / world  # noqa: E731

    losses: List[float] = []
    log: List[Dict[str, Any]] = []
    steps_log: List[Tuple[int, float, float, float]] = []  # (step, train seconds, loss, wire bytes)
    acc_log: List[Tuple[int, float, float]] = []  # (step, train seconds, accuracy), rank 0
    accs = []
    train_s = 0.0  # time in training steps; evaluation excluded
    step = 0
    epochs = int(args.get("epochs", 1))
    wire_seen = 0  # the hook's total wire bytes at the last step
    sample_frac: List[float] = []
    done = False
    for epoch in range(epochs):
        perm = torch.from_numpy(np.random.default_rng(seed * 1000 + epoch).permutation(len(xtr)))
        for s in range(steps_per_epoch):
            if max_steps and step >= max_steps:
                done = True
                break
            idx = perm[s * per_step + rank * batch: s * per_step + (rank + 1) * batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            if M == 1:
                loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                step_loss = float(loss)
            else:
                parts = idx.view(M, batch // M)
                delays = _slow_delays(seed, step, M, args) if slow else None
                mb_losses = []

                def micro(m, scale):
                    lm = torch.nn.functional.cross_entropy(model(xtr[parts[m]]), ytr[parts[m]])
                    (lm * scale).backward()
                    mb_losses.append(float(lm))
                    if delays is not None:
                        time.sleep(float(delays[m]))
                if dc is None:
                    for m in range(M):
                        if m < M - 1:
                            with model.no_sync():
                                micro(m, 1.0 / M)
                        else:
                            micro(m, 1.0 / M)
                else:
                    for m, _ in enumerate(dc.microbatches(iter(range(M)))):
                        micro(m, 1.0)
                sample_frac.append(len(mb_losses) / M)
                step_loss = sum(mb_losses) / len(mb_losses)
            rec = None
            if diag is not None and step % log_every == 0:
                rec = {"step": step, "layers": diag.record()}
            opt.step()
            train_s += time.perf_counter() - t0
            losses.append(step_loss)
            if state is not None:
                total = state.totals["wire_bytes"]
                wire, wire_seen = total - wire_seen, total
            else:
                wire = ring_wire(plain_bytes)
            steps_log.append((step, train_s, step_loss, wire))
            if rec is not None or step % log_every == 0:
                rec = rec or {"step": step}
                rec["loss"] = sum(losses[-log_every:]) / len(losses[-log_every:])
                if diag is not None and state is not None:
                    rec["error"] = _error_norms(state, names)
                log.append(rec)
            step += 1
            if eval_every and step % eval_every == 0 and rank == 0:
                acc_log.append((step, train_s, _evaluate(model, xte, yte)))
        if done:
            break
        accs.append(_evaluate(model, xte, yte))
        if rank == 0:
            if not acc_log or acc_log[-1][0] != step:
                acc_log.append((step, train_s, accs[-1]))
            print(f"  {args['config']} seed {seed}: epoch {epoch + 1}/{epochs}, step {step}, "
                  f"test accuracy {100 * accs[-1]:.2f}%, {train_s:.1f} s training", flush=True)
    if done or not accs:
        accs.append(_evaluate(model, xte, yte))
        if rank == 0 and (not acc_log or acc_log[-1][0] != step):
            acc_log.append((step, train_s, accs[-1]))
    # every rank's fraction of the nominal samples it computed (DropCompute drops some)
    import torch.distributed as dist

    fr = torch.zeros(world, dtype=torch.float64)
    fr[rank] = (sum(sample_frac) / len(sample_frac)) if sample_frac else 1.0
    dist.all_reduce(fr)
    hist = state.history if state is not None else []
    sent = [h["bytes_sent"] for h in hist[-10:]] if hist else []
    wire = [h["wire_bytes"] for h in hist[-10:]] if hist else []
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        res = {"config": args["config"], "seed": seed, "world": world, "lr": lr, "steps": step,
               "model": args.get("model", "cnn"), "params": dense // 4,
               "steps_per_epoch": steps_per_epoch,
               "accuracy": accs[-1], "accuracy_per_epoch": accs,
               # (step, seconds of training so far, test accuracy)
               "accuracy_log": acc_log,
               "wall_s": train_s,
               "final_loss": sum(losses[-25:]) / max(1, len(losses[-25:])),
               "dense_bytes": dense,
               "bytes_sent_per_step": ((sum(sent) / len(sent)) if state is not None and sent
                                       else None if state is not None else plain_bytes),
               # on this rank's link (ring allreduce / direct all-to-all / ring allgather):
               # plain DDP's allreduce moves 2 (P-1)/P of the dense bytes
               "wire_bytes_per_step": ((sum(wire) / len(wire)) if state is not None and wire
                                       else None if state is not None else ring_wire(plain_bytes)),
               "plain_wire_bytes_per_step": ring_wire(dense),
               "micro_batches": M,
               "samples_fraction": float(fr.mean()), "samples_fraction_per_rank": fr.tolist(),
               "dropcompute_tau": (dc.tau if dc is not None else None),
               "steps_log": steps_log,
               "log": log}
        with open(out_path, "w") as f:
            json.dump(res, f)


def _error_norms(state, names) -> Dict[str, float]:
    """1-bit hook: L2 norm of the worker error-feedback memory per parameter (sliced by the
    bucket's parameter layout) and of this rank's server error per bucket."""
    out: Dict[str, float] = {}
    for i, b in state.buckets.items():
        p = getattr(b.plan, "plan", b.plan)
        if not hasattr(p, "worker_error"):
            continue
        we = np.asarray(p.worker_error())
        off = 0
        for key, shape in zip(b.layout, b.shapes):
            n = int(np.prod(shape)) if shape else 1
            out[names[key]] = float(np.linalg.norm(we[off:off + n]))
            off += n
        out[f"server_error[bucket {i}]"] = float(np.linalg.norm(np.asarray(p.server_error())))
    return out


# ---- launcher ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, init, args, out_path):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if isinstance(init, int):
        init = f"tcp://127.0.0.1:{init}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(args.get("timeout", 1800))))
    try:
        train_rank(rank, world, args, out_path)
    finally:
        dist.destroy_process_group()
    # the results are written: end without interpreter teardown, where torch 2.15 + gloo aborted
    # a rank now and then ("terminate called without an active exception"; 2 of 50 DDP jobs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_config(args: Dict[str, Any], world: int = 4, netns: str = "",
               delay: str = "") -> Dict[str, Any]:
    """Trains one configuration on `world` gloo ranks in fresh processes; returns rank 0's
    result (accuracy, loss log, training time, bytes per step). With `netns` (root) every rank
    runs in its own network namespace with links of that rate (gradcomp.experiments.netem);
    else all ranks talk over loopback."""
    config_flags(args["config"])  # reject a bad suffix before starting anything
    parse_config(args["config"])
    fd, out_path = tempfile.mkstemp(prefix="gradcomp-fmnist-", suffix=".json")
    os.close(fd)
    try:
        if netns:
            from gradcomp.experiments import netem

            blob = json.dumps(args)
            netem.run_in_namespaces(
                world, netns,
                lambda r: [sys.executable, "-m", "gradcomp.experiments.fashion_mnist",
                           "--_rank", str(r), "--world", str(world),
                           "--_init", f"tcp://{netem.RANK0_ADDR}:29517", "--_args", blob,
                           "--_result", out_path],
                timeout=float(args.get("timeout", 1800)), delay=delay)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_entry, args=(world, _free_port(), args, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


# ---- report ------------------------------------------------------------------------------------
#: PyTorch's hook of the same kind, for the "vs PyTorch" column
COUNTERPART = {"fp16": "torch-fp16", "powersgd": "torch-powersgd"}


def time_to_target(r: Dict[str, Any], target: float) -> Optional[float]:
    """Seconds of training until the first evaluation at or above `target`, or None."""
    for _, t, acc in r["accuracy_log"]:
        if acc >= target:
            return float(t)
    return None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(results: Sequence[Dict[str, Any]], target: float) -> List[Dict[str, Any]]:
    """One row per configuration (in first-seen order), over its seeds: mean final accuracy,
    each seed's, mean training time, mean time to `target` (None if a seed never reached it),
    wire bytes per step, and speedups in time to target vs plain DDP, vs PyTorch's hook of the
    same kind and, for '+slow+dropcompute', vs the same run without DropCompute."""
    by: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    rows = []
    for cfg, rs in by.items():
        ttt = [time_to_target(r, target) for r in rs]
        rows.append({
            "config": cfg, "seeds": [r["seed"] for r in rs],
            "accuracy": _mean([r["accuracy"] for r in rs]),
            "accuracies": [r["accuracy"] for r in rs],
            "epochs": rs[0]["steps"] / rs[0]["steps_per_epoch"],
            "train_s": _mean([r["wall_s"] for r in rs]),
            "step_s": _mean([r["wall_s"] / max(1, r["steps"]) for r in rs]),
            "time_to_target": None if None in ttt else _mean(ttt),
            "wire_bytes": _mean([r["wire_bytes_per_step"] for r in rs]),
            "plain_wire_bytes": rs[0]["plain_wire_bytes_per_step"],
            "samples_fraction": _mean([r.get("samples_fraction", 1.0) for r in rs]),
        })
    t = {row["config"]: row["time_to_target"] for row in rows}
    for row in rows:
        base = row["config"].split("+", 1)[0]
        ref = {"plain": t.get("plain"), "torch": t.get(COUNTERPART.get(base, "")),
               "no_dropcompute": (t.get(row["config"].replace("+dropcompute", ""))
                                  if row["config"].endswith("+dropcompute") else None)}
        for k, v in ref.items():
            row[f"speedup_vs_{k}"] = (v / row["time_to_target"]
                                      if v and row["time_to_target"] else None)
    return rows


def _fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def markdown_table(rows: Sequence[Dict[str, Any]], target: float) -> str:
    head = ("| config | test accuracy (mean; per seed) | vs plain | epochs | training time | "
            f"time to {100 * target:.0f}% | speedup vs plain | vs PyTorch's hook | "
            "vs no DropCompute | step time | wire bytes/step | fewer bytes than plain |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    plain = next((r for r in rows if r["config"] == "plain"), None)
    for r in rows:
        d = (100 * (r["accuracy"] - plain["accuracy"])) if plain and r is not plain else None
        wb = r["wire_bytes"]
        lines.append(
            f"| {r['config']} | {100 * r['accuracy']:.2f}% ("
            + ", ".join(f"{100 * a:.2f}" for a in r["accuracies"]) + ") | "
            f"{_fmt(d, '+.2f')} | {r['epochs']:.2f} | {r['train_s']:.0f} s | "
            f"{_fmt(r['time_to_target'], '.0f', 'not reached')}{'' if r['time_to_target'] is None else ' s'} | "
            f"{_fmt(r['speedup_vs_plain'], '.2f')}{'x' if r['speedup_vs_plain'] else ''} | "
            f"{_fmt(r['speedup_vs_torch'], '.2f')}{'x' if r['speedup_vs_torch'] else ''} | "
            f"{_fmt(r['speedup_vs_no_dropcompute'], '.2f')}{'x' if r['speedup_vs_no_dropcompute'] else ''} | "
            f"{1e3 * r['step_s']:.0f} ms | {_fmt(wb, ',.0f')} | "
            f"{_fmt(r['plain_wire_bytes'] / wb if wb else None, '.1f')}{'x' if wb else ''} |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[Dict[str, Any]], path_time: str, path_epoch: str, title: str,
         target: float) -> None:
    """Test accuracy against training time and against epochs, one line per configuration
    (seeds averaged where they share evaluation steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    for path, xkey, xlabel in ((path_time, 1, "training time (s), evaluation excluded"),
                               (path_epoch, 0, "epochs")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (cfg, rs) in enumerate(by.items()):
            n = min(len(r["accuracy_log"]) for r in rs)
            xs = [_mean([r["accuracy_log"][j][xkey] for r in rs]) for j in range(n)]
            if xkey == 0:
                xs = [x / rs[0]["steps_per_epoch"] for x in xs]
            ys = [100 * _mean([r["accuracy_log"][j][2] for r in rs]) for j in range(n)]
            style = "-" if i < 10 else "--"
            ax.plot(xs, ys, style, marker=".", label=cfg + (f" ({len(rs)} seeds)" if len(rs) > 1 else ""))
        ax.axhline(100 * target, color="gray", linewidth=0.8, linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(max(0, 100 * target - 25), None)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _git(*a) -> str:
    import subprocess

    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                              ).stdout.strip()  # the working directory's checkout
    except Exception:
        return ""


def write_report(results: Sequence[Dict[str, Any]], out_dir: str, target: float,
                 meta: Dict[str, Any], failed: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Writes results.jsonl, steps.csv (config, seed, step, seconds, loss, wire bytes),
    evals.csv, table.md and the two plots into out_dir; returns the summary rows."""
    import csv

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for r in list(results) + list(failed):
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out_dir, "steps.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "step", "train_s", "loss", "wire_bytes"])
        for r in results:
            for st, t, loss, wb in r["steps_log"]:
                w.writerow([r["config"], r["seed"], st, f"{t:.4f}", f"{loss:.5f}", f"{wb:.0f}"])
    with open(os.path.join(out_dir, "evals.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "step", "epoch", "train_s", "test_accuracy"])
        for r in results:
            for st, t, acc in r["accuracy_log"]:
                w.writerow([r["config"], r["seed"], st, f"{st / r['steps_per_epoch']:.4f}",
                            f"{t:.3f}", f"{acc:.4f}"])
    rows = summarize(results, target)
    title = (f"Fashion-MNIST, {meta['model']} ({results[0]['params'] / 1e6:.2f} M parameters), "
             f"{meta['world']} ranks, {meta['link']}")
    plot(results, os.path.join(out_dir, "accuracy_vs_time.png"),
         os.path.join(out_dir, "accuracy_vs_epoch.png"), title, target)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(f"# {title}\n\n")
        f.write(f"- Date: {meta['date']}. Code: commit {meta['commit']}. torch {meta['torch']}.\n")
        f.write(f"- Command: `{meta['command']}`"
                + (f"; table and plots: `{meta['regenerated_by']}`" if meta.get("regenerated_by")
                   else "") + "\n")
        f.write(f"- Machine: {os.cpu_count()}-core VM, shared; 1-minute load average before "
                f"{meta['load_before']:.2f}, after {meta['load_after']:.2f}; wall {meta['wall_s']:.0f} s.\n")
        f.write(f"- Setting: SGD lr {meta['lr']}, momentum {meta['momentum']} (in the hook with "
                f"`dgc_optimizer` for top-k, random-k with correction and 1-bit momentum), batch "
                f"{meta['batch']} per rank; training time excludes evaluation (rank 0, every "
                f"{meta['eval_every']} steps: time to target has that granularity). Wire bytes: "
                "on one rank's link per step (plain DDP: a ring allreduce, 2 (P-1)/P of the "
                "gradient bytes).\n\n")
        f.write(markdown_table(rows, target))
        for r in failed:
            f.write(f"\n- {r['config']} (seed {r['seed']}) did not finish: {r['error']}\n")
        f.write("\n![accuracy vs time](accuracy_vs_time.png)\n![accuracy vs epoch]"
                "(accuracy_vs_epoch.png)\n")
    return rows


def setting_of(results: Sequence[Dict[str, Any]], fallback: Dict[str, Any]) -> Dict[str, Any]:
    """The setting (model, world, link, lr, momentum, batch, eval_every) the runs recorded: a value
    shared by every run; "mixed: a / b" where they differ. A key no run recorded (runs from before
    it was recorded) takes ``fallback``'s value (the command's own options), if any."""
    out: Dict[str, Any] = {}
    for k in ("model", "world", "link", "lr", "momentum", "batch", "eval_every"):
        vals = sorted({json.dumps(r[k]) for r in results if k in r})
        if len(vals) == 1:
            out[k] = json.loads(vals[0])
        elif vals:
            out[k] = "mixed: " + " / ".join(str(json.loads(v)) for v in vals)
        elif fallback.get(k) is not None:
            out[k] = fallback[k]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="plain,onebit",
                    help=f"comma-separated: {', '.join(CONFIGS)} or hook:key=value;..., each "
                         "optionally with +slow or +slow+dropcompute")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    ap.add_argument("--model", default="cnn", choices=["cnn", "wide", "wide4096"])
    ap.add_argument("--train-subset", type=int, default=0)
    ap.add_argument("--test-subset", type=int, default=0)
    ap.add_argument("--diag", action="store_true", help="log per-layer gradient and error norms")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also record rank 0's test accuracy every this many steps (0: end only)")
    ap.add_argument("--micro-batches", type=int, default=4, help="per step, with +slow")
    ap.add_argument("--slow-base-ms", type=float, default=6.0)
    ap.add_argument("--slow-log-mu", type=float, default=math.log(2.0))
    ap.add_argument("--slow-log-sigma", type=float, default=2.0)
    ap.add_argument("--slow-cap-ms", type=float, default=80.0)
    ap.add_argument("--netns", default="", metavar="RATE",
                    help="root: each rank in its own network namespace, links of RATE (tc "
                         "syntax: 1gbit, 10gbit); default: loopback")
    ap.add_argument("--delay", default="", help="with --netns: added one-way delay, e.g. 100us")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds: bound on each configuration's run (and the gloo timeout)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="test accuracy (e.g. 0.85) for the time-to-accuracy columns")
    ap.add_argument("--report", default="", metavar="DIR",
                    help="write results.jsonl, steps.csv, evals.csv, table.md and plots here")
    ap.add_argument("--quick", action="store_true",
                    help="minutes: 2 ranks, 150 steps, 10k training and 2k test images, every "
                         "hook once, report under build/experiments/quick")
    ap.add_argument("--out", default="", help="append each result as a JSON line to this file")
    ap.add_argument("--from-results", default="", metavar="JSONL[,JSONL]",
                    help="no training: write --report from these files' results")
    ap.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_args", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_result", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._rank is not None:  # one rank of a --netns run, started inside its namespace
        _entry(a._rank, a.world, a._init, json.loads(a._args), a._result)
        return 0
    if a.quick:
        a.world, a.steps, a.train_subset, a.test_subset = 2, 150, 10000, 2000
        a.eval_every = a.eval_every or 25
        a.target = a.target or 0.75
        if a.configs == ap.get_default("configs"):
            a.configs = "plain,torch-fp16,fp16,topk-dgc,onebit-mc,powersgd,torch-powersgd"
        a.report = a.report or os.path.join("build", "experiments", "quick")
    for cfg in [c for c in a.configs.split(",") if c and not a.from_results]:
        parse_config(cfg)
        config_flags(cfg)
    load_split("test")  # fail early with the package hint
    if a.netns and not a.from_results:  # with --from-results, --netns only labels old runs
        from gradcomp.experiments import netem

        netem.require_root()
    link = f"links of {a.netns} (network namespaces)" if a.netns else "loopback"
    results: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    if a.from_results:  # regenerate the report from earlier runs' JSON lines
        for path in a.from_results.split(","):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    (failed if "error" in r else results).append(r)
        a.configs, a.seeds = "", ""
    t_start = time.time()
    load_before = os.getloadavg()[0]
    for seed in [int(s) for s in a.seeds.split(",") if s]:
        for cfg in [c for c in a.configs.split(",") if c]:
            args = dict(config=cfg, seed=seed, lr=a.lr, momentum=a.momentum, batch=a.batch,
                        epochs=a.epochs, steps=a.steps, model=a.model,
                        train_subset=a.train_subset, test_subset=a.test_subset, diag=a.diag,
                        log_every=a.log_every, eval_every=a.eval_every,
                        micro_batches=a.micro_batches, slow_base_ms=a.slow_base_ms,
                        slow_log_mu=a.slow_log_mu, slow_log_sigma=a.slow_log_sigma,
                        slow_cap_ms=a.slow_cap_ms, timeout=a.timeout)
            try:
                r = run_config(args, a.world, netns=a.netns, delay=a.delay)
            except Exception as e:  # a diverged run (non-finite check) or a failed rank
                # recorded, and the other configurations still run; the exit status says so
                failed.append({"config": cfg, "seed": seed, "error": _last_line(e)})
                print(f"{cfg:24s} seed {seed}: FAILED: {failed[-1]['error']}", flush=True)
                continue
            r.update(link=link, momentum=a.momentum, batch=a.batch, eval_every=a.eval_every)
            results.append(r)
            bps = r["bytes_sent_per_step"]
            ratio = f"{r['dense_bytes'] / bps:7.1f}x" if bps else "    n/a"
            wbps = r["wire_bytes_per_step"]
            ratio += f" (wire {r['plain_wire_bytes_per_step'] / wbps:6.1f}x)" if wbps else ""
            losses = " ".join(f"{e['loss']:.2f}" for e in r["log"][::4])
            if r["accuracy_log"]:
                losses += "  acc: " + " ".join(f"{s}:{100 * v:.1f}" for s, _, v in r["accuracy_log"])
            print(f"{cfg:24s} seed {seed}: acc {100 * r['accuracy']:5.2f}%  loss {r['final_loss']:.3f}"
                  f"  {r['wall_s']:6.1f}s  dense/sent {ratio}  losses: {losses}", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    if a.out:
        with open(a.out, "a") as f:
            for r in failed:
                f.write(json.dumps(r) + "\n")
    if a.report:
        import torch

        meta = dict(date=datetime.date.today().isoformat(),
                    commit=(_git("rev-parse", "--short", "HEAD") or "unknown")
                    + (" (with uncommitted changes)" if _git("status", "--porcelain",
                                                             "--untracked-files=no") else ""),
                    torch=torch.__version__, command="python -m gradcomp.experiments.fashion_mnist "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    load_before=load_before, load_after=os.getloadavg()[0],
                    wall_s=time.time() - t_start, model=a.model, world=a.world,
                    link=link, lr=a.lr, momentum=a.momentum, batch=a.batch,
                    eval_every=a.eval_every)
        if a.from_results:  # the setting as the runs recorded it, not this command's defaults
            meta.update(setting_of(results, dict(meta, link=link if a.netns else (
                "not recorded by these runs (--netns RATE labels them)"))))  # the runs' own metadata, where their report folder has it
            mpath = os.path.join(os.path.dirname(a.from_results.split(",")[0]), "meta.json")
            if os.path.exists(mpath):
                with open(mpath) as f:
                    meta = dict(json.load(f), regenerated_by=meta["command"])
        os.makedirs(a.report, exist_ok=True)
        with open(os.path.join(a.report, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        rows = write_report(results, a.report, a.target or 0.8, meta, failed)
        print(markdown_table(rows, a.target or 0.8))
        print(f"report: {a.report}")
    if failed:
        print("did not finish: " + "; ".join(f"{r['config']} (seed {r['seed']}): {r['error']}"
                                             for r in failed), flush=True)
    # a report records diverged runs as results; without one, a failure is the exit status
    return 0 if (a.report or not failed) else 1


def _last_line(e: BaseException) -> str:
    """The last non-empty line of an exception's text: for a rank's exception (re-raised with its
    whole traceback by torch.multiprocessing) the error itself, e.g. the non-finite check."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
