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
    a communication-bound variant."""
    import torch.nn as nn

    hidden = {"cnn": 256, "wide": 2048}[kind]
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10))


# ---- configurations --------------------------------------------------------------------------
# name -> (hook name or None for plain DDP, hook options, optimizer momentum applied by the hook)
CONFIGS: Dict[str, Tuple[Optional[str], Dict[str, Any], bool]] = {
    "plain": (None, {}, False),
    "fp16": ("fp16", {}, False),
    "bf16": ("bf16", {}, False),
    "topk": ("topk", dict(ratio=0.001, momentum=0.9), True),
    "randomk": ("randomk", dict(ratio=0.01), False),
    "randomk-mc": ("randomk", dict(ratio=0.01, momentum=0.9), True),
    "randomk10": ("randomk", dict(ratio=0.1), False),
    "randomk10-mc": ("randomk", dict(ratio=0.1, momentum=0.9), True),
    "onebit": ("onebit", {}, False),
    "onebit-mc": ("onebit", dict(momentum=0.9), True),
    "powersgd": ("powersgd", dict(rank=4), False),
}


def parse_config(spec: str) -> Tuple[str, Optional[str], Dict[str, Any], bool]:
    """'name' from CONFIGS, or 'hook:key=value,...' (values parsed as JSON, else strings), e.g.
    'onebit:block_size=0'. A hook option 'momentum' makes the hook apply momentum (plain SGD then)."""
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


def train_rank(rank: int, world: int, args: Dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    _, hook_name, opts, hook_momentum = parse_config(args["config"])
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
    if hook_name is not None:
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
    losses: List[float] = []
    log: List[Dict[str, Any]] = []
    t_start = time.perf_counter()
    step = 0
    epochs = int(args.get("epochs", 1))
    accs = []
    eval_every = int(args.get("eval_every") or 0)
    acc_log: List[Tuple[int, float]] = []  # (step, test accuracy) every eval_every steps, rank 0
    for epoch in range(epochs):
        perm = torch.from_numpy(np.random.default_rng(seed * 1000 + epoch).permutation(len(xtr)))
        for s in range(steps_per_epoch):
            if max_steps and step >= max_steps:
                break
            idx = perm[s * per_step + rank * batch: s * per_step + (rank + 1) * batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            rec = None
            if diag is not None and step % log_every == 0:
                rec = {"step": step, "layers": diag.record()}
            opt.step()
            losses.append(float(loss))
            if rec is not None or step % log_every == 0:
                rec = rec or {"step": step}
                rec["loss"] = sum(losses[-log_every:]) / len(losses[-log_every:])
                if diag is not None and state is not None:
                    rec["error"] = _error_norms(state, names)
                log.append(rec)
            step += 1
            if eval_every and step % eval_every == 0 and rank == 0:
                acc_log.append((step, _evaluate(model, xte, yte)))
        accs.append(_evaluate(model, xte, yte))
    wall = time.perf_counter() - t_start
    hist = state.history if state is not None else []
    sent = [h["bytes_sent"] for h in hist[-10:]] if hist else []
    wire = [h["wire_bytes"] for h in hist[-10:]] if hist else []
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        res = {"config": args["config"], "seed": seed, "world": world, "lr": lr, "steps": step,
               "accuracy": accs[-1], "accuracy_per_epoch": accs, "accuracy_log": acc_log,
               "wall_s": wall,
               "final_loss": sum(losses[-25:]) / max(1, len(losses[-25:])),
               "dense_bytes": dense,
               "bytes_sent_per_step": (sum(sent) / len(sent)) if sent else None,
               # on this rank's link (ring allreduce / direct all-to-all / ring allgather):
               # plain DDP's allreduce moves 2 (P-1)/P of the dense bytes
               "wire_bytes_per_step": (sum(wire) / len(wire)) if wire else None,
               "plain_wire_bytes_per_step": 2 * (world - 1) * dense / world,
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


def _entry(rank, world, port, args, out_path):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        train_rank(rank, world, args, out_path)
    finally:
        dist.destroy_process_group()
    # the results are written: end without interpreter teardown, where torch 2.15 + gloo aborted
    # a rank now and then ("terminate called without an active exception"; 2 of 50 DDP jobs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_config(args: Dict[str, Any], world: int = 4) -> Dict[str, Any]:
    """Trains one configuration on `world` gloo ranks in fresh processes; returns rank 0's
    result (accuracy, loss log, wall time, bytes per step)."""
    import torch.multiprocessing as mp

    fd, out_path = tempfile.mkstemp(prefix="gradcomp-fmnist-", suffix=".json")
    os.close(fd)
    try:
        mp.spawn(_entry, args=(world, _free_port(), args, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="plain,onebit",
                    help=f"comma-separated: {', '.join(CONFIGS)} or hook:key=value;...")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    ap.add_argument("--model", default="cnn", choices=["cnn", "wide"])
    ap.add_argument("--train-subset", type=int, default=0)
    ap.add_argument("--test-subset", type=int, default=0)
    ap.add_argument("--diag", action="store_true", help="log per-layer gradient and error norms")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also record rank 0's test accuracy every this many steps (0: end only)")
    ap.add_argument("--out", default="", help="append each result as a JSON line to this file")
    a = ap.parse_args(argv)
    load_split("test")  # fail early with the package hint
    results = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for cfg in a.configs.split(","):
            args = dict(config=cfg, seed=seed, lr=a.lr, momentum=a.momentum, batch=a.batch,
                        epochs=a.epochs, steps=a.steps, model=a.model,
                        train_subset=a.train_subset, test_subset=a.test_subset, diag=a.diag,
                        log_every=a.log_every, eval_every=a.eval_every)
            r = run_config(args, a.world)
            results.append(r)
            bps = r["bytes_sent_per_step"]
            ratio = f"{r['dense_bytes'] / bps:7.1f}x" if bps else "    n/a"
            wbps = r["wire_bytes_per_step"]
            ratio += f" (wire {r['plain_wire_bytes_per_step'] / wbps:6.1f}x)" if wbps else ""
            losses = " ".join(f"{e['loss']:.2f}" for e in r["log"][::4])
            if r["accuracy_log"]:
                losses += "  acc: " + " ".join(f"{s}:{100 * v:.1f}" for s, v in r["accuracy_log"])
            print(f"{cfg:24s} seed {seed}: acc {100 * r['accuracy']:5.2f}%  loss {r['final_loss']:.3f}"
                  f"  {r['wall_s']:6.1f}s  dense/sent {ratio}  losses: {losses}", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
