# SPDX-License-Identifier: Apache-2.0
"""The main job's summary: one table from the Google Benchmark JSON files of one run.

    python bench/summarize.py RESULTS_DIR [--no-plot]

Reads RESULTS_DIR/bench_{topk,onebit,quant,powersgd,comm}.json (those present; scripts/bench.sh writes
them with --benchmark_out) and writes RESULTS_DIR/summary.md, summary.csv and summary.png, then
prints the Markdown table. Per compressor setting and gradient size:

- ratio: dense bytes / payload bytes (headers included), from the encoder's own statistics;
- encode / decode ms: mean real time per call (PowerSGD: one whole local step, which encodes
  and decodes: its P, Q and reconstruction are interleaved, so there is no separate decode);
- encode / decode GB/s: dense gradient bytes (4 n) per second, so that every compressor is
  measured by the same yardstick: how fast a gradient of this size goes through;
- speedup: the baseline's time / ours, both in the same binary and run (top-k: sampled selection
  vs std::nth_element on |g|; 1-bit: fused compress vs the unfused 5-pass one; PowerSGD: our step
  vs the same math structured as PyTorch's powerSGD_hook);
- frac of memcpy: bandwidth of the bytes the kernel must move / the bandwidth of a memcpy
  measured by the same binary (see bench/bench_common.hpp and each bench_*.cpp);
- step ms / vs plain: bench_comm, one whole compressed allreduce step (encode, collectives,
  decode) at its gradient size with the ranks it ran with, and plain allreduce's step time / it.

The PNG plots compression ratio against encode throughput, one point per compressor setting at
the size the comm benchmark uses (25M elements, ResNet-50 for PowerSGD).
"""
import argparse
import csv
import json
import math
import os
import sys
from typing import Dict, List, Optional

ONEBIT_MODES = {0: "column means", 1: "sign L1", 2: "sign L2"}
PSGD_MODELS = {0: "ResNet-50", 1: "BERT-base"}
COMM_CASES = {  # bench_comm case -> (compressor, setting) of the table
    "baseline_dense": ("allreduce", "plain fp32"),
    "cast_fp16": ("fp16", "cast"),
    "topk_1pct": ("topk", "1%"),
    "topk_0.1pct": ("topk", "0.1%"),
    "randomk_1pct": ("randomk", "1%"),
    "onebit": ("onebit", "sign L2"),
    "quant_4bit": ("quant", "4 bits"),
    "powersgd_r4": ("powersgd", "r=4"),
}
COLUMNS = ["compressor", "setting", "elements", "ratio", "encode_ms", "encode_GBps", "decode_ms",
           "decode_GBps", "speedup", "baseline", "frac_of_memcpy", "step_ms", "vs_plain"]
HEADER = ["compressor", "setting", "elements", "ratio", "encode ms", "encode GB/s", "decode ms",
          "decode GB/s", "speedup", "over baseline", "frac of memcpy", "step ms ({ranks})",
          "vs plain allreduce"]


def _ms(b: dict) -> float:
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
    return float(b["real_time"]) * scale


def load(path: str) -> Optional[dict]:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None  # not run, or the filter matched none of its benchmarks
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            print(f"summarize: {path} is not valid JSON ({e}); was the run cut off? Left out.",
                  file=sys.stderr)
            return None
    runs = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        runs[b["name"]] = b
    return {"context": data.get("context", {}), "runs": runs}


def _args(name: str) -> Dict[str, int]:
    """'BM_x/n:25000000/density_e4:10/real_time' -> {'n': 25000000, 'density_e4': 10}; unnamed
    arguments get their position ('0', '1', ...)."""
    out, pos = {}, 0
    for part in name.split("/")[1:]:
        if ":" in part:
            k, v = part.split(":", 1)
        else:
            k, v = str(pos), part
        pos += 1
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def _find(runs: dict, prefix: str, **want) -> Optional[dict]:
    for name, b in runs.items():
        if name.split("/")[0] != prefix:
            continue
        a = _args(name)
        if all(a.get(k) == v for k, v in want.items()):
            return b
    return None


def _row(**kw) -> dict:
    r = {c: None for c in COLUMNS}
    r.update(kw)
    return r


def _gbps(n: int, ms: Optional[float]) -> Optional[float]:
    return 4.0 * n / (ms * 1e-3) / 1e9 if ms else None


def topk_rows(runs: dict) -> List[dict]:
    rows = []
    for name, enc in runs.items():
        if not name.startswith("BM_topk_encode/"):
            continue
        a = _args(name)
        n, d = a["n"], a["density_e4"]
        dec = _find(runs, "BM_topk_decode", n=n, density_e4=d)
        sel = _find(runs, "BM_topk_sampled_select", n=n, density_e4=d)
        base = _find(runs, "BM_topk_baseline_nth_element", n=n, density_e4=d)
        e_ms, d_ms = _ms(enc), (_ms(dec) if dec else None)
        rows.append(_row(
            compressor="topk", setting=f"{d / 100:g}%", elements=n,
            ratio=enc.get("compression_ratio"), encode_ms=e_ms, encode_GBps=_gbps(n, e_ms),
            decode_ms=d_ms, decode_GBps=_gbps(n, d_ms),
            speedup=_ms(base) / _ms(sel) if sel and base else None,
            baseline="selection vs std::nth_element" if sel and base else None,
            frac_of_memcpy=enc.get("frac_of_copy")))
    return rows


def onebit_rows(runs: dict) -> List[dict]:
    rows = []
    for name, enc in runs.items():
        if not name.startswith("BM_onebit_compress/"):
            continue
        a = _args(name)
        n, mode, checked = a["0"], a["1"], a["2"]
        if not checked:  # the in-place variant: same numbers within noise, kept in the full table
            continue
        dec = _find(runs, "BM_onebit_decompress_accumulate", **{"0": n, "1": mode})
        base = _find(runs, "BM_onebit_baseline_compress", **{"0": n})
        e_ms, d_ms = _ms(enc), (_ms(dec) if dec else None)
        rows.append(_row(
            compressor="onebit", setting=ONEBIT_MODES.get(mode, str(mode)), elements=n,
            ratio=enc.get("compression_ratio"), encode_ms=e_ms, encode_GBps=_gbps(n, e_ms),
            decode_ms=d_ms, decode_GBps=_gbps(n, d_ms),
            speedup=_ms(base) / e_ms if base else None,
            baseline="unfused 5-pass compress" if base else None,
            frac_of_memcpy=enc.get("frac_of_copy")))
    return rows


def quant_rows(runs: dict) -> List[dict]:
    """The multi-bit codec: compress with error feedback (fused, the plan's kernel) against the
    bandwidth of a copy; the averaging decode of one payload where the run has it (4 bits)."""
    rows = []
    for name, enc in runs.items():
        if not name.startswith("BM_quant_compress/"):
            continue
        a = _args(name)
        n, bits = a["0"], a["1"]
        dec = _find(runs, "BM_quant_decode_average", **{"0": n, "1": bits, "2": 1})
        e_ms, d_ms = _ms(enc), (_ms(dec) if dec else None)
        rows.append(_row(
            compressor="quant", setting=f"{bits} bits", elements=n,
            ratio=enc.get("compression_ratio"), encode_ms=e_ms, encode_GBps=_gbps(n, e_ms),
            decode_ms=d_ms, decode_GBps=_gbps(n, d_ms), frac_of_memcpy=enc.get("frac_of_copy")))
    return rows


def powersgd_rows(runs: dict) -> List[dict]:
    rows = []
    for name, st in runs.items():
        if not name.startswith("BM_powersgd_step/"):
            continue
        a = _args(name)
        model, r = a["model"], a["r"]
        base = _find(runs, "BM_powersgd_baseline_step", model=model, r=r)
        ms = _ms(st)
        n = int(st["elements"]) if "elements" in st else None
        rows.append(_row(
            compressor="powersgd", setting=f"r={r}, {PSGD_MODELS.get(model, model)}",
            elements=n, ratio=st.get("compression_ratio"), encode_ms=ms,
            encode_GBps=_gbps(n, ms) if n else None, decode_ms=None, decode_GBps=None,
            speedup=_ms(base) / ms if base else None,
            baseline="PyTorch's step structure" if base else None,
            frac_of_memcpy=st.get("frac_of_copy")))
    return rows


def attach_comm(rows: List[dict], comm: Optional[dict], ranks: Optional[int],
                numel: Optional[int]) -> List[dict]:
    """Adds the step time and speedup of bench_comm's cases to the matching rows (same
    compressor and setting at the comm benchmark's size; PowerSGD r=4 on ResNet-50), and rows
    of their own for the cases with no kernel benchmark (plain, fp16, random-k)."""
    if comm is None:
        return rows
    for name, b in comm["runs"].items():
        case = name.split("/")[0].replace("BM_comm_", "")
        if case not in COMM_CASES:
            continue
        comp, setting = COMM_CASES[case]
        step = _ms(b)
        vs = b.get("speedup_vs_plain") if ranks and ranks > 1 else None
        target = None
        for r in rows:
            if r["compressor"] != comp:
                continue
            if comp == "powersgd" and r["setting"] == "r=4, ResNet-50":
                target = r
            elif r["setting"] == setting and r["elements"] == numel:
                target = r
        if target is None:
            target = _row(compressor=comp, setting=setting, elements=numel,
                          ratio=b.get("compression_ratio") if ranks and ranks > 1 else None)
            rows.append(target)
        target["step_ms"] = step
        target["vs_plain"] = vs
    return rows


def _fmt(c: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if c == "elements":
        return f"{v / 1e6:.1f}M" if v >= 1e6 else f"{v:,}"
    if c in ("ratio",):
        return f"{v:.1f}x" if v < 100 else f"{v:.0f}x"
    if c in ("speedup", "vs_plain"):
        return f"{v:.2f}x"
    if c.endswith("_ms"):
        return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    if c.endswith("GBps"):
        return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    if c == "frac_of_memcpy":
        return f"{v:.2f}"
    return str(v)


def markdown(rows: List[dict], ranks: Optional[int]) -> str:
    label = (f"{ranks} rank" + ("s" if ranks != 1 else "")) if ranks else "ranks"
    head = [h.format(ranks=label) for h in HEADER]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: List[dict], path: str, numel: int, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("summarize: matplotlib not importable, no plot", file=sys.stderr)
        return False
    pts = [r for r in rows if r["ratio"] and r["encode_GBps"]]
    at_size = [r for r in pts if r["elements"] == numel or r["setting"].endswith("ResNet-50")]
    if at_size:  # one gradient size (the comm benchmark's); a filtered run may lack it
        pts = at_size
    if not pts:
        print("summarize: no row has both a ratio and an encode time, no plot", file=sys.stderr)
        return False
    colors = {"topk": "tab:blue", "onebit": "tab:orange", "quant": "tab:purple",
              "powersgd": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for comp in colors:
        sel = [r for r in pts if r["compressor"] == comp]
        if sel:
            ax.scatter([r["encode_GBps"] for r in sel], [r["ratio"] for r in sel], s=50,
                       color=colors[comp], label=comp, zorder=3)
        # labels of points at the same ratio (within 5%: the 1-bit settings) go on separate
        # lines: above, below, further above, further below, in order of throughput; a point
        # alone at its ratio is labelled above right (alternating every point made PowerSGD's
        # r=1 and r=2 labels collide)
        offsets = [(6, 5), (6, -13), (6, 17), (6, -25)]
        placed: List[float] = []
        for r in sorted(sel, key=lambda r: r["encode_GBps"]):
            i = sum(1 for q in placed if abs(q - r["ratio"]) <= 0.05 * r["ratio"])
            placed.append(r["ratio"])
            ax.annotate(f'{r["setting"].replace(", ResNet-50", "")} ({_fmt("ratio", r["ratio"])})',
                        (r["encode_GBps"], r["ratio"]), textcoords="offset points",
                        xytext=offsets[i % len(offsets)], fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    major = FuncFormatter(lambda v, _: f"{v:g}")
    minor = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else "")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(major)
        axis.set_minor_formatter(minor)
    ax.set_xlabel("encode throughput (GB/s of fp32 gradient, log scale)")
    ax.set_ylabel("compression ratio (dense bytes / payload bytes, log scale)")
    sizes = sorted({r["elements"] for r in pts if r["compressor"] != "powersgd" and r["elements"]})
    what = ", ".join(_fmt("elements", n) for n in sizes)
    ax.set_title(f"{title}\ngradient of {what} fp32 elements (PowerSGD: ResNet-50's layers, 1 thread), "
                 "one point per compressor setting", fontsize=9)
    ax.margins(x=0.12, y=0.12)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Summarise one scripts/bench.sh run.")
    ap.add_argument("results_dir")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    d = a.results_dir
    if not os.path.isdir(d):
        ap.error(f"{d} is not a directory")
    parts = {k: load(os.path.join(d, f"bench_{k}.json"))
             for k in ("topk", "onebit", "quant", "powersgd", "comm")}
    if not any(parts.values()):
        ap.error(f"no bench_*.json in {d}: nothing to summarise")
    meta = {}
    if os.path.exists(os.path.join(d, "run.json")):
        with open(os.path.join(d, "run.json")) as f:
            meta = json.load(f)
    ranks, numel = None, 25_000_000
    if parts["comm"] is not None:  # bench_comm records them in its JSON context
        ctx = parts["comm"]["context"]
        ranks = int(ctx["comm_ranks"]) if "comm_ranks" in ctx else None
        numel = int(ctx.get("comm_numel", numel))
    rows = []
    if parts["topk"]:
        rows += sorted(topk_rows(parts["topk"]["runs"]),
                       key=lambda r: (r["elements"], -float(r["setting"][:-1])))
    if parts["onebit"]:
        rows += sorted(onebit_rows(parts["onebit"]["runs"]),
                       key=lambda r: (r["elements"], r["setting"]))
    if parts["quant"]:
        rows += sorted(quant_rows(parts["quant"]["runs"]),
                       key=lambda r: (r["elements"], -int(r["setting"].split()[0])))
    if parts["powersgd"]:
        rows += sorted(powersgd_rows(parts["powersgd"]["runs"]),
                       key=lambda r: (r["elements"] or 0, int(r["setting"][2:].split(",")[0])))
    rows = attach_comm(rows, parts["comm"], ranks, numel)
    order = {"allreduce": 0, "fp16": 1, "topk": 2, "randomk": 3, "onebit": 4, "quant": 5,
             "powersgd": 6}
    rows.sort(key=lambda r: order.get(r["compressor"], 9))  # stable: keeps the orders above

    table = markdown(rows, ranks)
    with open(os.path.join(d, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r[c] is None else r[c]) for c in COLUMNS})
    notes = []
    if parts["comm"] is not None:
        if ranks and ranks > 1:
            notes.append(f"step ms: bench_comm with {ranks} MPI ranks on this machine "
                         f"({numel:,} elements; {meta.get('comm_transport', 'loopback')}); "
                         "vs plain allreduce = plain step time / this step time.")
        else:
            notes.append("step ms: bench_comm ran with ONE rank: nothing is communicated, so "
                         "the step time is local work only and no speedup over plain allreduce "
                         "is measured (blank).")
    else:
        notes.append("bench_comm did not run: no step times.")
    if "load_before" in meta:
        notes.append(f"machine: {meta.get('machine', '?')}; uptime before: "
                     f"{meta['load_before']}; after: {meta.get('load_after', '?')}. On a loaded "
                     "machine OpenMP kernels wait for descheduled threads: small gradients (1M) "
                     "suffer most.")
    title = f"gradcomp on {meta.get('machine', 'this machine')}, {meta.get('date', '')}"
    with open(os.path.join(d, "summary.md"), "w") as f:
        f.write(f"# {title}\n\n")
        for k in ("command", "commit", "load_before", "load_after", "omp_threads"):
            if k in meta:
                f.write(f"- {k.replace('_', ' ')}: {meta[k]}\n")
        f.write("\n" + table + "\n\n")
        f.write("\n".join("- " + n for n in notes) + "\n")
        f.write("- GB/s: dense fp32 gradient bytes (4 x elements) per second. PowerSGD's encode "
                "column is one whole local step (encode and decode interleave). Definitions: "
                "bench/summarize.py.\n")
    if not a.no_plot:
        if plot(rows, os.path.join(d, "summary.png"), numel, title):
            print(f"summarize: wrote {os.path.join(d, 'summary.png')}")
    print(table)
    for n in notes:
        print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
