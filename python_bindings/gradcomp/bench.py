# SPDX-License-Identifier: Apache-2.0
"""Compression ratios and times for your own model's gradients.

    python -m gradcomp.bench --model torchvision:resnet50        # needs torchvision
    python -m gradcomp.bench --model mymodule:make_model         # a function returning a Module
    python -m gradcomp.bench --shapes shapes.json --gbps 10 --world 8

Builds the model's parameter list (shapes only: the model is made with random initial weights,
nothing is downloaded; a shapes file needs no torch at all), splits it into DDP's buckets (the
last parameters first, 1 MiB for the first bucket, then --bucket-mb, 25 MiB by default), fills it
with a normal(0, 1) gradient, and runs every compressor over every bucket as the DDP hooks do:
the fp16 and bf16 casts, top-k at several densities, random-k, 1-bit and quant at 2, 4 and 8 bits
(the bucket plans the hooks build, with the hooks' defaults: for 1-bit a scaled sign with one L2
scale per rotated block of 128, worker and server error; their local work timed at world size
1, their payload the first phase's), PowerSGD at ranks 1, 2, 4 and 8 (per-tensor matrices; 1-D
tensors and tensors it does not shrink go uncompressed). For each it prints the bytes one rank sends
per step, the compression ratio (dense bytes / compressed bytes, headers included) and the
encode + decode time per step on this machine (median of --repeat steps after one warm-up).

With --gbps (link bandwidth in Gbit/s) and --world (ranks, default 8) it also estimates the
communication time per step, bandwidth term only (no latency, no overlap with compute), from the
bytes each rank moves with bandwidth-optimal collectives:

- allreduce of B bytes (plain, fp16, random-k values, PowerSGD's P and Q): 2 (P-1)/P x B;
- allgather of B bytes from every rank (top-k's sparse route): (P-1) x B; top-k's plan switches
  to a dense allreduce when that is cheaper, and so does this estimate;
- 1-bit's and quant's two phases (all-to-all, then allgather of the recompressed chunks):
  2 (P-1)/P x B;

and "vs allreduce" = plain allreduce's communication time / (this compressor's communication
time + its encode + decode time).
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

Shape = Tuple[int, ...]

TOPK_DENSITIES = (0.01, 0.001, 0.0001)
POWERSGD_RANKS = (1, 2, 4, 8)
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES


class BenchError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


# ---- the parameter list -----------------------------------------------------------------------
def shapes_from_model(spec: str) -> Tuple[str, List[Shape]]:
    """'module:callable' (or 'module:attr.attr'): imports module, calls the callable with no
    arguments (or takes the Module it names) and returns the shapes of its trainable parameters.
    'torchvision:NAME' looks NAME up in torchvision.models too."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise BenchError(f"--model takes MODULE:CALLABLE (e.g. torchvision:resnet50 or "
                         f"mymodule:make_model), got {spec!r}")
    try:
        import torch
    except ImportError as e:
        raise BenchError(f"--model needs torch ({e}); --shapes FILE.json does not") from None
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        hint = " (pip install torchvision)" if mod_name.split(".")[0] == "torchvision" else (
            " (is its directory the current one or on PYTHONPATH?)")
        raise BenchError(f"--model {spec}: cannot import {mod_name!r}: {e}{hint}") from None
    obj = _lookup(mod, attr)
    if obj is None and mod_name == "torchvision":
        obj = _lookup(importlib.import_module("torchvision.models"), attr)
    if obj is None:
        raise BenchError(f"--model {spec}: module {mod_name!r} has no attribute {attr!r}")
    model = obj
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise BenchError(f"--model {spec}: {attr!r} is neither a torch.nn.Module nor callable")
        try:
            model = obj()
        except Exception as e:  # the user's code: report it, whatever it is
            raise BenchError(f"--model {spec}: calling {attr}() failed: "
                             f"{type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise BenchError(f"--model {spec}: {attr}() returned {type(model).__name__}, "
                         "not a torch.nn.Module")
    shapes = [tuple(int(d) for d in p.shape) for p in model.parameters() if p.requires_grad]
    if not shapes:
        raise BenchError(f"--model {spec}: the model has no trainable parameters")
    return spec, shapes


def _lookup(mod, attr: str):
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def shapes_from_json(path: str) -> Tuple[str, List[Shape]]:
    """A JSON file holding a list of shapes ([[64, 3, 7, 7], [64], ...]), an object of
    name -> shape, or either under the key "shapes". A shape is a list of positive integers
    ([] is a scalar)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise BenchError(f"--shapes {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise BenchError(f"--shapes {path}: not valid JSON: {e}") from None
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = [(f"[{i}]", s) for i, s in enumerate(data)]
    else:
        raise BenchError(f"--shapes {path}: expected a list of shapes or an object of name -> "
                         f"shape, got {type(data).__name__}")
    if not items:
        raise BenchError(f"--shapes {path}: no shapes in it")
    shapes = []
    for name, s in items:
        if isinstance(s, int) and not isinstance(s, bool):
            s = [s]
        if not isinstance(s, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in s):
            raise BenchError(f"--shapes {path}: entry {name} must be a list of positive "
                             f"integers, got {json.dumps(s)}")
        shapes.append(tuple(s))
    return os.path.basename(path), shapes


def numel(shape: Shape) -> int:
    return int(math.prod(shape)) if shape else 1


def ddp_buckets(shapes: Sequence[Shape], bucket_bytes: int,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> List[List[int]]:
    """Indices of `shapes` per bucket, as DDP forms them for fp32 gradients: parameters in reverse
    order, a bucket closed once it holds at least its cap (the first one's cap is 1 MiB)."""
    buckets, cur, size = [], [], 0
    cap = first_bucket_bytes
    for i in reversed(range(len(shapes))):
        cur.append(i)
        size += 4 * numel(shapes[i])
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, bucket_bytes
    if cur:
        buckets.append(cur)
    return buckets


# ---- the compressors --------------------------------------------------------------------------
class Setting:
    """One compressor setting over all buckets: make() builds per-bucket state, step() runs one
    encode + decode of every bucket and returns the bytes this rank sends, and collective is how
    those bytes travel (for the communication estimate)."""

    def __init__(self, compressor: str, label: str, collective: str):
        self.compressor, self.label, self.collective = compressor, label, collective

    def make(self, buckets: List["Bucket"]) -> None:
        raise NotImplementedError

    def step(self, buckets: List["Bucket"]) -> int:
        raise NotImplementedError


class Bucket:
    def __init__(self, shapes: List[Shape], grad: np.ndarray, work: np.ndarray, out: np.ndarray):
        self.shapes, self.grad, self.work, self.out = shapes, grad, work, out
        self.numel = grad.size

    def tensors(self, buf: np.ndarray) -> List[np.ndarray]:
        views, off = [], 0
        for s in self.shapes:
            n = numel(s)
            views.append(buf[off:off + n].reshape(s if s else (1,)))
            off += n
        return views


def run_local(plan) -> None:
    """Drives a begun plan of world size 1: every collective's result is its input."""
    while True:
        c = plan.next()
        if c is None:
            return
        if not c.in_place:
            c.recv()[:] = c.send()


class _Sparse(Setting):
    def __init__(self, compressor: str, ratio: float, factory: Callable, collective: str):
        super().__init__(compressor, f"{ratio * 100:g}%", collective)
        self.factory = factory
        self.ratio = ratio

    def make(self, buckets):
        from gradcomp import _C
        self.comps = [self.factory(_C, b.numel, i) for i, b in enumerate(buckets)]
        self.payloads = [_C.Payload() for _ in buckets]

    def step(self, buckets):
        sent = 0
        for b, c, p in zip(buckets, self.comps, self.payloads):
            c.encode(b.grad, p)
            c.decode_add(p.array(), b.out, 1.0)
            sent += p.nbytes
        return sent


class _Cast(Setting):
    def __init__(self, dtype: str = "fp16"):
        super().__init__(dtype, "cast", "allreduce")

    def make(self, buckets):
        from gradcomp import _C
        self.plans = [_C.make_plan(self.compressor, b.numel, "float32", 1,
                                    options=dict(route="allreduce")) for b in buckets]

    def step(self, buckets):
        for b, p in zip(buckets, self.plans):
            p.begin(b.work)
            run_local(p)
        return sum(2 * b.numel for b in buckets)


class _TwoPhase(Setting):
    """A two-phase family's bucket plan (1-bit, quant) at world size 1 with the hooks' defaults
    and the given options: the time is its whole local work as a hook runs it (rotation,
    compression, error feedback, the recompression and decode of the second phase), the payload
    the bytes of its first phase, the compressed bucket every rank sends (the estimate charges
    both phases with it)."""

    def __init__(self, compressor: str, label: str, **options):
        super().__init__(compressor, label, "two-phase")
        self.options = options

    def make(self, buckets):
        from gradcomp import _C
        self.plans = [_C.make_plan(self.compressor, b.numel, "float32", 1, bucket_id=i,
                                   options=self.options) for i, b in enumerate(buckets)]

    def step(self, buckets):
        sent = 0
        for b, p in zip(buckets, self.plans):
            b.work[:] = b.grad
            p.begin(b.work)
            first = True
            while True:
                c = p.next()
                if c is None:
                    break
                if first:
                    sent += c.send().nbytes
                    first = False
                if not c.in_place:
                    c.recv()[:] = c.send()
        return sent


class _PowerSGD(Setting):
    def __init__(self, rank: int):
        super().__init__("powersgd", f"r={rank}", "allreduce")
        self.rank = rank

    def make(self, buckets):
        from gradcomp import _C
        self.states = [_C.PowerSGDState([list(s) if s else [1] for s in b.shapes],
                                        rank=self.rank, first_tensor_id=i * 65536)
                       for i, b in enumerate(buckets)]
        self.plans = [_C.PowerSGDPlan(st, 1) for st in self.states]

    def step(self, buckets):
        sent = 0
        for b, st, p in zip(buckets, self.states, self.plans):
            p.begin(b.tensors(b.work))
            run_local(p)
            sent += int(st.last_stats["sent_bytes"])
        return sent


def settings(densities: Sequence[float] = TOPK_DENSITIES,
             ranks: Sequence[int] = POWERSGD_RANKS) -> List[Setting]:
    out: List[Setting] = [_Cast("fp16"), _Cast("bf16")]
    for d in densities:
        out.append(_Sparse("topk", d, lambda C, n, i, d=d: C.TopKCompressor(
            n, ratio=d, tensor_id=i), "allgather"))
    out.append(_Sparse("randomk", 0.01, lambda C, n, i: C.RandomKCompressor(
        n, ratio=0.01, tensor_id=i), "allreduce"))
    out.append(_TwoPhase("onebit", "sign, L2 scale/128, rotated"))
    out += [_TwoPhase("quant", f"{b} bits", bits=b) for b in (8, 4, 2)]
    out += [_PowerSGD(r) for r in ranks]
    return out


# ---- the communication estimate ---------------------------------------------------------------
def link_bytes(collective: str, payload: float, dense: float, world: int) -> float:
    """Bytes one rank sends per step with bandwidth-optimal collectives (see the module doc)."""
    P = world
    allreduce = 2.0 * (P - 1) / P
    if collective == "allreduce":
        return allreduce * payload
    if collective == "two-phase":
        return allreduce * payload
    if collective == "allgather":  # top-k: the plan densifies when that is cheaper
        return min((P - 1) * payload, allreduce * dense)
    raise ValueError(f"unknown collective {collective!r}")


def comm_seconds(nbytes: float, gbps: float) -> float:
    return nbytes * 8.0 / (gbps * 1e9)


# ---- progress ---------------------------------------------------------------------------------
class Progress:
    """tqdm when it is installed, otherwise one plain line per setting on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="step", file=sys.stderr, leave=False)
            except ImportError:
                self.bar = None

    def describe(self, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(what)
        else:
            print(f"[{self.done:>{len(str(self.total))}}/{self.total} steps] {what}",
                  file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- the run ----------------------------------------------------------------------------------
def measure(shapes: Sequence[Shape], bucket_mb: float = 25.0, repeat: int = 3,
            densities: Sequence[float] = TOPK_DENSITIES, ranks: Sequence[int] = POWERSGD_RANKS,
            progress: bool = False, seed: int = 0) -> Tuple[List[dict], List[List[int]]]:
    """Runs every setting over the buckets of `shapes`; one dict per setting (compressor, setting,
    dense_bytes, bytes, ratio, ms = median encode + decode milliseconds per step, collective)."""
    order = ddp_buckets(shapes, int(bucket_mb * 1024 * 1024))
    n = sum(numel(s) for s in shapes)
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal(n, dtype=np.float32)
    work = np.empty_like(grad)
    out = np.zeros_like(grad)
    buckets, off = [], 0
    for idx in order:
        bs = [shapes[i] for i in idx]
        m = sum(numel(s) for s in bs)
        buckets.append(Bucket(bs, grad[off:off + m], work[off:off + m], out[off:off + m]))
        off += m
    todo = settings(densities, ranks)
    bar = Progress(len(todo) * (repeat + 1), progress)
    rows = [dict(compressor="allreduce", setting="plain fp32", dense_bytes=4 * n, bytes=4 * n,
                 ratio=1.0, ms=0.0, collective="allreduce")]
    try:
        for i, s in enumerate(todo):
            bar.describe(f"{s.compressor} {s.label}")
            s.make(buckets)
            times, sent = [], 0
            for it in range(repeat + 1):  # the first step is a warm-up (allocations)
                np.copyto(work, grad)  # the plans write in place: a fresh gradient, not timed
                t0 = time.perf_counter()
                sent = s.step(buckets)
                if it > 0:
                    times.append(time.perf_counter() - t0)
                bar.advance()
            rows.append(dict(compressor=s.compressor, setting=s.label, dense_bytes=4 * n,
                             bytes=sent, ratio=4.0 * n / sent if sent else float("inf"),
                             ms=1e3 * statistics.median(times), collective=s.collective))
            todo[i] = s = None  # frees its per-bucket state before the next setting
    finally:
        bar.close()
    return rows, order


def add_estimate(rows: List[dict], gbps: float, world: int) -> None:
    plain = None
    for r in rows:
        r["comm_ms"] = 1e3 * comm_seconds(
            link_bytes(r["collective"], r["bytes"], r["dense_bytes"], world), gbps)
        r["total_ms"] = r["comm_ms"] + r["ms"]
        if r["compressor"] == "allreduce":
            plain = r["total_ms"]
    for r in rows:
        r["vs_allreduce"] = plain / r["total_ms"] if r["total_ms"] > 0 else float("inf")


def _size(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}" if b / f < 100 else f"{b / f:.0f} {unit}"
    return f"{b:.0f} B"


def table(rows: List[dict], estimate: bool) -> str:
    head = ["compressor", "setting", "bytes/step", "ratio", "encode+decode ms"]
    if estimate:
        head += ["comm ms (est.)", "comm + codec ms", "vs allreduce"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["compressor"], r["setting"], _size(r["bytes"]),
                 f"{r['ratio']:.1f}x" if r["ratio"] < 99.95 else f"{r['ratio']:.0f}x",
                 f"{r['ms']:.1f}" if r["ms"] >= 1 else f"{r['ms']:.3f}"]
        if estimate:
            cells += [f"{r['comm_ms']:.1f}", f"{r['total_ms']:.1f}", f"{r['vs_allreduce']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _positive_float(what: str) -> Callable[[str], float]:
    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {v!r}") from None
        if not (x > 0 and math.isfinite(x)):
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {v}")
        return x
    return parse


def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
    def parse(v: str) -> int:
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {v!r}") from None
        if x < lo:
            raise argparse.ArgumentTypeError(f"{what} must be at least {lo}, got {x}")
        return x
    return parse


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradcomp.bench",
        description="Bytes per step, compression ratio and encode + decode time of every gradcomp "
                    "compressor on your model's gradients; with --gbps, the estimated "
                    "communication time per step against plain allreduce.",
        epilog="The communication estimate and the bucket layout are described in "
               "gradcomp/bench.py's docstring.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="MODULE:CALLABLE",
                     help="e.g. torchvision:resnet50 or mymodule:make_model (a function "
                          "returning a torch.nn.Module, or a Module)")
    src.add_argument("--shapes", metavar="FILE.json",
                     help="parameter shapes: [[64, 3, 7, 7], [64], ...] or {name: shape}")
    ap.add_argument("--gbps", type=_positive_float("--gbps"),
                    help="link bandwidth in Gbit/s: adds the estimated communication time")
    ap.add_argument("--world", type=_int_at_least(2, "--world"), default=8,
                    help="ranks for the communication estimate (default 8)")
    ap.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=25.0,
                    help="DDP bucket_cap_mb (default 25)")
    ap.add_argument("--repeat", type=_int_at_least(1, "--repeat"), default=3,
                    help="timed steps per setting after one warm-up (default 3; the median)")
    ap.add_argument("--threads", type=_int_at_least(0, "--threads"), default=0,
                    help="CPU threads for the kernels (default 0: all cores)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    try:
        name, shapes = shapes_from_model(a.model) if a.model else shapes_from_json(a.shapes)
    except BenchError as e:
        print(f"gradcomp.bench: error: {e}", file=sys.stderr)
        return 2
    import gradcomp
    gradcomp.set_cpu_threads(a.threads)  # importing torch may have left OpenMP at 1 thread
    n = sum(numel(s) for s in shapes)
    rows, order = measure(shapes, a.bucket_mb, a.repeat, progress=not a.no_progress)
    estimate = a.gbps is not None
    if estimate:
        add_estimate(rows, a.gbps, a.world)
    print(f"{name}: {n:,} parameters in {len(shapes)} tensors, {_size(4 * n)} of fp32 gradient "
          f"per step, {len(order)} DDP buckets ({a.bucket_mb:g} MB)")
    print(f"encode + decode: median of {a.repeat} steps on this machine "
          f"({gradcomp.cpu_threads()} CPU threads), every bucket, one decode per payload")
    if estimate:
        print(f"communication: estimated for {a.world} ranks on {a.gbps:g} Gbit/s links, "
              "bandwidth term only (ring allreduce moves 2(P-1)/P of the buffer per rank)")
    print()
    print(table(rows, estimate))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(source=name, parameters=n, tensors=len(shapes), buckets=len(order),
                           world=a.world if estimate else None, gbps=a.gbps, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
