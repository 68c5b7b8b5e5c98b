# SPDX-License-Identifier: Apache-2.0
"""gradcomp's GPU kernels against PyTorch baselines, in one process, on the same data.

Usage::

    python bench/gpu_bench.py --device cuda --out DIR [--commit SHA]   # the GPU run (~1 min)
    OMP_NUM_THREADS=1 python bench/gpu_bench.py --device cpu --small --out DIR  # dry run, gloo

Writes DIR/gpu_bench.json (all numbers, trials, checks, tracebacks) and DIR/gpu_bench.md (the
table, also printed) after each section. Sections: copy, topk, topk_ef, onebit, powersgd; each bench_*
docstring says what its numbers mean. Each case has its own try/except (a failure is an error
row, the rest runs); exit status 1 if any failed, 2 if the watchdog (--max-seconds) fired.
Timing: 3 warm-up calls, 5 trials of up to 20 calls (about 0.3 s per case); ms = the median
trial's ms per call. CUDA: events on the current stream (gradcomp is given that stream); DDP
steps and the CPU: perf_counter. Every timer stops after a synchronize.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import gradcomp

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT: Dict[str, Any] = {"meta": {}, "rows": [], "errors": [], "details": {}}
COLS = ["section", "case", "n", "ms", "torch_ms", "speedup", "GB/s", "frac_of_copy", "check"]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device, wall: bool = False, warmup: int = 3,
          trials: int = 5, max_reps: int = 20, budget_s: float = 0.3) -> Dict[str, Any]:
    """Median over `trials` of the ms per call of fn (see the module docstring)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    reps = max(1, min(max_reps, int(budget_s / trials / max(time.perf_counter() - t0, 1e-9))))
    out = []
    for _ in range(trials):
        if dev.type == "cuda" and not wall:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync(dev)
            out.append((time.perf_counter() - t0) * 1e3 / reps)
    return {"ms": statistics.median(out), "trials_ms": out, "reps": reps}


def row(section: str, case: str, n: int, ms: Optional[float], **kw) -> None:
    RESULT["rows"].append({"section": section, "case": case, "n": n, "ms": ms, **kw})


def bw_row(section: str, case: str, n: int, t: Dict[str, Any], nbytes: float,
           copy_bw: Dict[int, float], torch_ms: Optional[float] = None, **kw) -> None:
    """GB/s = nbytes / t, frac_of_copy = that / copy bandwidth(n), speedup = torch_ms / ms."""
    bps = nbytes / (t["ms"] * 1e-3)
    row(section, case, n, t["ms"], torch_ms=torch_ms, trials_ms=t["trials_ms"],
        speedup=torch_ms / t["ms"] if torch_ms else None, **kw,
        **{"GB/s": bps / 1e9, "frac_of_copy": bps / copy_bw[n] if n in copy_bw else None})


def guard(section: str, case: str, fn: Callable[[], Any], n: int = 0) -> Any:
    """Runs one case; a failure becomes an error row (the traceback's last line) and None."""
    try:
        return fn()
    except Exception:
        tb = traceback.format_exc()
        last = tb.strip().splitlines()[-1]
        RESULT["errors"].append({"section": section, "case": case, "n": n, "error": last,
                                 "traceback": tb})
        row(section, case, n, None, check="ERROR: " + last)
        print(f"[{section}] {case} failed: {last}", file=sys.stderr, flush=True)
        return None


def randn(shape, dev: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    return torch.randn(shape, device=dev, generator=gen)


def gc_kw(dev: torch.device) -> Dict[str, Any]:
    """Where a gradcomp codec lives: device, index and torch's current stream (0 on the CPU)."""
    st = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    return {"device": dev.type, "device_index": dev.index or 0, "stream": st}


# ---- 1. copy -------------------------------------------------------------------------------------
def bench_copy(dev: torch.device, sizes: List[int], copy_bw: Dict[int, float]) -> None:
    """The reference "copy bandwidth": dst.copy_(src) of n fp32, bytes/s counting read + write
    (8n bytes). Fills copy_bw[n]."""
    for n in sizes:
        def one(n=n):
            src, dst = torch.ones(n, device=dev), torch.empty(n, device=dev)
            t = timed(lambda: dst.copy_(src), dev)
            copy_bw[n] = 8 * n / (t["ms"] * 1e-3)
            bw_row("copy", "dst.copy_(src)", n, t, 8 * n, copy_bw)
        guard("copy", "dst.copy_(src)", one, n)


def check_topk_payload(c, p, g: torch.Tensor, k: int, method: str, ref: Dict[str, Any],
                       stream: int) -> tuple:
    """(ok, count) for the payload p that c.encode just wrote from g: decoded, it holds `count`
    values equal to g's (count == p.count == c.last_stats["count"]), all in the true top-k (the
    smallest selected |g| >= ref["kth"], torch's k-th largest, when known), and count == k for
    "exact", in [ceil(0.8 k), k] for "sampled" (SelectOptions.min_fraction)."""
    dense = torch.zeros_like(g)
    c.decode_add(p.array(), dense, 1.0, stream)
    sel = dense != 0
    got = int(sel.sum().item())
    lo = k if method == "exact" else math.ceil(0.8 * k)
    ok = (got == p.count == c.last_stats["count"] and lo <= got <= k
          and bool(torch.equal(dense[sel], g[sel]))
          and ("kth" not in ref or dense[sel].abs().min().item() >= ref["kth"]))
    return ok, got


def gc_topk_row(section: str, name: str, dev: torch.device, g, k: int, method: str,
                ref: Dict[str, Any], copy_bw: Dict[int, float], nbytes: int,
                error_feedback: bool, **extra) -> None:
    """One gradcomp row of the top-k sections: TopKCompressor.encode of g timed and its payload
    checked (check_topk_payload). With error feedback the payload checked is the first encode's,
    from a zero residual (v = g), before the timed calls grow the residual; without, every
    encode selects from g itself and the last timed one is checked."""
    n = g.numel()
    kw = gc_kw(dev)
    c = gradcomp.TopKCompressor(n, ratio=0.001, method=method, error_feedback=error_feedback,
                                **kw, **extra)
    p = gradcomp.Payload()
    if error_feedback:
        c.encode(g, p, kw["stream"])
        ok, got = check_topk_payload(c, p, g, k, method, ref, kw["stream"])
        t = timed(lambda: c.encode(g, p, kw["stream"]), dev)
    else:
        t = timed(lambda: c.encode(g, p, kw["stream"]), dev)
        ok, got = check_topk_payload(c, p, g, k, method, ref, kw["stream"])
    first = "first " if error_feedback else ""
    bw_row(section, name, n, t, nbytes, copy_bw, ref.get("ms"),
           check=f"{'ok' if ok else 'FAIL'} {first}count={got} k={k}", k=k,
           last_stats=dict(c.last_stats), payload_bytes=p.nbytes)
    if not ok:
        raise AssertionError(f"{name}: {got} selected (k={k}) or values not top-k")


# ---- 2. topk -------------------------------------------------------------------------------------
def bench_topk(dev: torch.device, sizes: List[int], copy_bw: Dict[int, float]) -> None:
    """TopKCompressor.encode at density 0.1% (k = ceil(0.001 n)) with error_feedback=False (each
    encode selects from g itself, as torch.topk does) against torch.topk(g.abs(), k,
    sorted=False). encode does more than select: a finiteness check (a variant turns it off),
    the selection, the gather of the values, the payload (header, raw or bitmap indices). GB/s
    and frac_of_copy count one read of g (4n bytes), as bench/bench_topk_cuda.cpp does.
    check: the decoded payload holds `count` values equal to g's, all in the true top-k (the
    smallest |g| selected >= torch's k-th largest |g|); count == k for "exact", in
    [ceil(0.8 k), k] for "sampled" (SelectOptions.min_fraction, include/gradcomp/select.hpp)."""
    for n in sizes:
        k = math.ceil(0.001 * n)
        g = randn(n, dev, seed=1)
        ref: Dict[str, Any] = {}

        def torch_case():
            t = timed(lambda: torch.topk(g.abs(), k, sorted=False), dev)
            ref["ms"], ref["kth"] = t["ms"], torch.topk(g.abs(), k, sorted=False)[0].min().item()
            bw_row("topk", "torch.topk(g.abs(), k, sorted=False)", n, t, 4 * n, copy_bw, k=k)
        guard("topk", "torch.topk", torch_case, n)

        for method, extra in (("sampled", {}), ("exact", {}), ("sampled", {"check_finite": False})):
            name = f"gradcomp {method}" + "".join(f" {a}={b}" for a, b in extra.items())

            def gc_case(method=method, extra=extra, name=name):
                gc_topk_row("topk", name, dev, g, k, method, ref, copy_bw, 4 * n, False, **extra)
            guard("topk", name, gc_case, n)
        del g
        gc.collect()


def bench_topk_ef(dev: torch.device, sizes: List[int], copy_bw: Dict[int, float]) -> None:
    """TopKCompressor.encode at density 0.1% with error feedback (the residual v holds what was
    not sent: v += g, select the k largest |v|, send them, clear them in v) against the form a
    user would write in PyTorch on the same data: `v.add_(g); idx = torch.topk(v.abs(), k,
    sorted=False)[1]; vals = v[idx]; v[idx] = 0`. Both keep a residual across calls, so each
    timed call selects from a residual that has grown as it would in training. GB/s and
    frac_of_copy count 12n bytes (read g and v, write v: the least any such encode moves).
    check: on a fresh residual (v = g) the first encode's payload holds `count` values equal to
    g's, all in the true top-k, count in [ceil(0.8 k), k] ("sampled") or k ("exact")."""
    for n in sizes:
        k = math.ceil(0.001 * n)
        g = randn(n, dev, seed=3)
        ref: Dict[str, Any] = {}

        def torch_case():
            v = torch.zeros(n, device=dev)

            def step():
                v.add_(g)
                idx = torch.topk(v.abs(), k, sorted=False)[1]
                vals = v[idx]
                v[idx] = 0
                return vals, idx
            t = timed(step, dev)
            ref["ms"], ref["kth"] = t["ms"], torch.topk(g.abs(), k, sorted=False)[0].min().item()
            bw_row("topk_ef", "torch: v.add_(g); topk(v.abs()); v[idx] = 0", n, t, 12 * n,
                   copy_bw, k=k)
        guard("topk_ef", "torch", torch_case, n)

        for method in ("sampled", "exact"):
            name = f"gradcomp {method} error_feedback=True"

            def gc_case(method=method, name=name):
                gc_topk_row("topk_ef", name, dev, g, k, method, ref, copy_bw, 12 * n, True)
            guard("topk_ef", name, gc_case, n)
        del g
        gc.collect()


# ---- 3. onebit -----------------------------------------------------------------------------------
def bench_onebit(dev: torch.device, sizes: List[int], copy_bw: Dict[int, float]) -> None:
    """OneBitCompressor.encode of g (n x 1) with error feedback: "column_means" (1-bit
    SGD) and "sign_l2" with one scale for the tensor and with one per 128 elements (chunk=128:
    the class's default and the DDP hook's, which also rotates blocks, as this class does not). Bytes per encode = read g (4n) + read error (4n) + write error (4n) + the payload
    (packed bits n/8, scales, header: Payload.nbytes); GB/s = bytes / t. "torch ref" is a
    hand-written unfused scaled sign in PyTorch on the same data (x = g + e, s = ||x||_2 /
    sqrt(n), bits packed 8 per byte, e = x - s sign(x)), the same bytes counted: speedup is
    against it, not against a PyTorch library function."""
    for n in sizes:
        g = randn(n, dev, seed=2)
        ref: Dict[str, float] = {}

        def torch_case():
            e, x = torch.zeros(n, device=dev), torch.empty(n, device=dev)
            w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=dev)
            m = n // 8 * 8

            def step():
                torch.add(g, e, out=x)
                s = torch.linalg.vector_norm(x) / math.sqrt(n)
                bits = ((x[:m] >= 0).view(-1, 8).to(torch.uint8) * w).sum(1, dtype=torch.uint8)
                torch.sub(x, torch.sign(x) * s, out=e)
                return bits
            t = timed(step, dev)
            ref["ms"] = t["ms"]
            bw_row("onebit", "torch ref sign_l2 (unfused)", n, t, 12 * n + n // 8 + 4, copy_bw)
        guard("onebit", "torch ref", torch_case, n)

        for scaling, chunk, check in (("column_means", 0, True), ("sign_l2", 0, True),
                                      ("sign_l2", 128, True), ("sign_l2", 128, False)):
            name = (f"gradcomp {scaling}" + (f" chunk={chunk}" if chunk else "")
                    + ("" if check else " check_finite=False"))

            def gc_case(scaling=scaling, chunk=chunk, check=check, name=name):
                kw = gc_kw(dev)
                c = gradcomp.OneBitCompressor(n, 1, scaling=scaling, error_feedback=True,
                                              block_size=chunk, check_finite=check, **kw)
                p = gradcomp.Payload()
                t = timed(lambda: c.encode(g, p, kw["stream"]), dev)
                ok = p.count == n and c.last_stats["numel"] == n
                bw_row("onebit", name, n, t, 12 * n + p.nbytes, copy_bw, ref.get("ms"),
                       check=f"{'ok' if ok else 'FAIL'} payload={p.nbytes}B",
                       last_stats=dict(c.last_stats))
            guard("onebit", name, gc_case, n)
        del g
        gc.collect()


# ---- 4. powersgd ---------------------------------------------------------------------------------
def bert_base_shapes(small: bool) -> List[List[int]]:
    """BERT-base's parameter shapes (torch Linear layout: [out, in]); small: dims / 8."""
    h, ff, vocab, pos = (96, 384, 3815, 64) if small else (768, 3072, 30522, 512)
    s = [[vocab, h], [pos, h], [2, h], [h], [h]]  # embeddings, their LayerNorm
    for _ in range(12):
        s += [[h, h], [h]] * 4 + [[h], [h]]  # q, k, v, attention output; LayerNorm
        s += [[ff, h], [ff], [h, ff], [h], [h], [h]]  # FFN in, FFN out; LayerNorm
    return s + [[h, h], [h]]  # pooler


def resnet50_shapes(small: bool) -> List[List[int]]:
    """bench/shapes/resnet50.json's shapes (torchvision order); small: dims >= 64 / 8."""
    with open(os.path.join(HERE, "shapes", "resnet50.json")) as f:
        shapes = json.load(f)["shapes"]
    return [[d // 8 if d >= 64 else d for d in s] for s in shapes] if small else shapes


class ShapeModel(torch.nn.Module):
    """Parameters of the given shapes; forward = sum_p (p * w_p).sum(), so each gradient is the
    fixed random w_p and backward is cheap: DDP's communication (the hook) dominates a step."""

    def __init__(self, shapes: List[List[int]], w: List[torch.Tensor], dev: torch.device):
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes])
        self.w = w  # a plain list: neither parameters nor buffers, so DDP leaves them alone

    def forward(self) -> torch.Tensor:
        return sum((p * w).sum() for p, w in zip(self.ps, self.w))


def bench_powersgd(dev: torch.device, small: bool) -> None:
    """ms per DDP step (zero_grad + forward + backward + synchronize; wall clock), world size 1,
    DDP's default buckets, a fresh DDP model per variant, timed after 5 steps (2 plain allreduce
    before start_iter, 3 compressed). Variants: no hook, PyTorch's powerSGD_hook, ours
    (gt.hook("powersgd")) with the same options, and ours with check_finite=False (PyTorch's hook
    does not scan for NaN/Inf). torch_ms: PyTorch's hook; speedup = t_torch / t_ours; "hook
    speedup" = (t_torch - t_nohook) / (t_ours - t_nohook), the ratio of what each hook adds to
    a step. rel_err = ||averaged grad - true grad|| / ||true grad|| after the 5th step: the
    gradient is the same every step, so error feedback grows the error and rel_err can pass 1;
    it should be about the same for both hooks (their initial Q differs) and equal for our two."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp.torch as gt

    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))

    def torch_hook_waited(state, bucket):
        fut = ps.powerSGD_hook(state, bucket)
        fut.wait()
        return fut

    try:
        for model_name, shapes in (("resnet50", resnet50_shapes(small)),
                                   ("bert-base", bert_base_shapes(small))):
            w = [randn(s, dev, seed=3 + i) for i, s in enumerate(shapes)]
            n = sum(x.numel() for x in w)
            w_norm = math.sqrt(sum(float((x * x).sum()) for x in w))
            t: Dict[str, float] = {}
            for variant in ("no hook", "torch powerSGD_hook", "gradcomp powersgd",
                            "gradcomp powersgd check_finite=False"):
                def case(variant=variant):
                    ddp = DDP(ShapeModel(shapes, w, dev),
                              device_ids=None)  # (a forward without inputs: nothing to move)
                    ours, state = variant.startswith("gradcomp"), None
                    if variant.startswith("torch"):
                        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                 start_powerSGD_iter=2, use_error_feedback=True,
                                                 warm_start=True, min_compression_rate=2)
                        # gloo (the CPU dry run) only: PyTorch's hook with several buckets hangs
                        # or aborts there (docs/USAGE.md, "DDP's default buckets work"), so it is
                        # waited for inside the hook (same arithmetic). On NCCL it runs as is.
                        ddp.register_comm_hook(state, ps.powerSGD_hook if dev.type == "cuda"
                                               else torch_hook_waited)
                    elif ours:
                        # torch's names -> ours: matrix_approximation_rank -> rank,
                        # start_powerSGD_iter -> start_iter; use_error_feedback, warm_start,
                        # min_compression_rate keep theirs (orthogonalization_epsilon: 0 in both).
                        extra = {"check_finite": False} if "check_finite" in variant else {}
                        state, hook = gt.hook("powersgd", model=ddp, rank=4, start_iter=2,
                                              use_error_feedback=True, warm_start=True,
                                              min_compression_rate=2.0, **extra)
                        ddp.register_comm_hook(state, hook)

                    def step():
                        ddp.zero_grad(set_to_none=True)
                        ddp().backward()
                        sync(dev)
                    for _ in range(5):
                        step()
                    err = math.sqrt(sum(float(((p.grad - x) ** 2).sum())
                                        for p, x in zip(ddp.module.ps, w))) / w_norm
                    r = timed(step, dev, wall=True, warmup=0)
                    t[variant] = r["ms"]
                    tt = t.get("torch powerSGD_hook") if ours else None
                    base, hs = t.get("no hook"), None
                    if tt is not None and base is not None and r["ms"] > base:
                        hs = (tt - base) / (r["ms"] - base)
                    row("powersgd", f"{model_name}: {variant}", n, r["ms"], torch_ms=tt,
                        speedup=tt / r["ms"] if tt else None, rel_err=err, hook_speedup=hs,
                        check=f"rel_err={err:.3g}" + (f" hook speedup={hs:.2f}" if hs else ""),
                        iter=getattr(state, "iter", None), trials_ms=r["trials_ms"],
                        totals=dict(state.totals) if ours else None)
                    if ours and state.iter < 5:  # a skipped step (NaN/Inf) does not count
                        raise AssertionError(f"our hook applied {state.iter} of >= 5 steps")
                guard("powersgd", f"{model_name}: {variant}", case, n)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


# ---- output --------------------------------------------------------------------------------------
def write(out: str) -> str:
    m = RESULT["meta"]
    fmt = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa
    lines = [f"# gradcomp GPU bench, {m['date_utc']}", "",
             f"device: {m['device_name']}; torch {m['torch']} (CUDA {m['torch_cuda']}); "
             f"gradcomp built_with_cuda={m['built_with_cuda']}; commit {m['commit']}; "
             f"small={m['small']}", "",
             "ms: median ms per call (per DDP step for powersgd); torch_ms: the PyTorch baseline "
             "on the same data; speedup = torch_ms / ms; GB/s: bytes moved / ms; frac_of_copy: "
             "GB/s / the copy bandwidth of the same n (which bytes: each section's docstring in "
             "bench/gpu_bench.py).", "",
             "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in COLS) + " |" for r in list(RESULT["rows"])]
    if RESULT["errors"]:
        lines += ["", "Errors:"] + [f"- {e['section']} / {e['case']} / n={e.get('n')}: {e['error']}"
                                    for e in list(RESULT["errors"])]
    md = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write(md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="small sizes (the CPU dry run)")
    ap.add_argument("--commit", default=None, help="the commit, recorded as given")
    ap.add_argument("--sections", default="copy,topk,topk_ef,onebit,powersgd")
    ap.add_argument("--max-seconds", type=float, default=200.0,
                    help="watchdog: write what there is and exit 2 after this long")
    a = ap.parse_args()
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    RESULT["meta"] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "built_with_cuda": gradcomp.built_with_cuda(), "commit": a.commit, "small": a.small,
        "python": sys.version.split()[0], "argv": sys.argv}
    current = ["start"]

    def watchdog():
        # (the main thread may be changing RESULT: whatever the write meets, the exit happens)
        try:
            RESULT["errors"].append({"section": current[0], "case": "watchdog",
                                     "error": f"still running after {a.max_seconds:.0f} s"})
            print(write(a.out), flush=True)
        finally:
            os._exit(2)
    timer = threading.Timer(a.max_seconds, watchdog)
    timer.daemon = True
    timer.start()

    sizes = [100_000, 1_000_003] if a.small else [25_000_000, 110_000_000]
    copy_bw: Dict[int, float] = {}
    t_start = time.perf_counter()
    for name, fn in (("copy", lambda: bench_copy(dev, sizes, copy_bw)),
                     ("topk", lambda: bench_topk(dev, sizes, copy_bw)),
                     ("topk_ef", lambda: bench_topk_ef(dev, sizes, copy_bw)),
                     ("onebit", lambda: bench_onebit(dev, sizes, copy_bw)),
                     ("powersgd", lambda: bench_powersgd(dev, a.small))):
        if name not in a.sections.split(","):
            continue
        current[0], t0 = name, time.perf_counter()
        guard(name, "section", fn)
        RESULT["details"][f"{name}_seconds"] = time.perf_counter() - t0
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        write(a.out)
    RESULT["details"]["total_seconds"] = time.perf_counter() - t_start
    timer.cancel()
    print(write(a.out), flush=True)
    return 1 if RESULT["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
