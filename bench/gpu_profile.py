# SPDX-License-Identifier: Apache-2.0
"""Where the GPU time of one encode goes: each CUDA kernel and copy of a gradcomp encode, from
torch.profiler (CUPTI sees the extension's launches too), summed over `--calls` calls.

Usage::

    python bench/gpu_profile.py --out DIR [--sizes 25000000,110000000] [--calls 10]

Writes DIR/gpu_profile.txt: per case (top-k sampled and exact at density 0.1% without error
feedback, as bench/gpu_bench.py times them; 1-bit sign_l2 with one scale per 128 elements and
error feedback) the wall time per call (after a synchronize) and the profiler's table of device
time per kernel. The gap between the wall time and the summed kernel time is launch overhead and
host synchronisation (the sampled select reads its candidate count back once per attempt).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import gradcomp


def cases(n: int, dev: torch.device):
    st = torch.cuda.current_stream(dev).cuda_stream
    kw = {"device": "cuda", "device_index": dev.index or 0, "stream": st}
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    g = torch.randn(n, device=dev, generator=gen)
    for method in ("sampled", "exact"):
        c = gradcomp.TopKCompressor(n, ratio=0.001, method=method, error_feedback=False, **kw)
        p = gradcomp.Payload()
        yield f"topk {method} k={math.ceil(0.001 * n)}", (lambda c=c, p=p: c.encode(g, p, st))
    c1 = gradcomp.OneBitCompressor(n, 1, scaling="sign_l2", error_feedback=True, block_size=128,
                                   **kw)
    p1 = gradcomp.Payload()
    yield "onebit sign_l2 chunk=128", (lambda: c1.encode(g, p1, st))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="25000000,110000000")
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    os.makedirs(a.out, exist_ok=True)
    lines = [f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; "
             f"{a.calls} calls per case", ""]
    for n in (int(s) for s in a.sizes.split(",")):
        for name, fn in cases(n, dev):
            for _ in range(3):
                fn()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize(dev)
            wall = (time.perf_counter() - t0) * 1e3 / a.calls
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(a.calls):
                    fn()
                torch.cuda.synchronize(dev)
            try:  # the sort key's name changed across torch 2.x releases
                table = prof.key_averages().table(sort_by="device_time_total", row_limit=25,
                                                  max_name_column_width=70)
            except (AttributeError, KeyError, ValueError):
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                                  max_name_column_width=70)
            lines += [f"== n={n} {name}: wall {wall:.4f} ms per call", table, ""]
            print(lines[-3], flush=True)
    with open(os.path.join(a.out, "gpu_profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
