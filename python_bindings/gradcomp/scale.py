# SPDX-License-Identifier: Apache-2.0
"""A scale model of a data-parallel step: predicted step time of each family, flat or
hierarchical, for P ranks in nodes of L, from per-element costs of each family's local work, an
alpha-beta model of each link level and the collective algorithms' byte counts.

    python -m gradcomp.scale --model gpt2-medium --per-node 8 --gbps 10 100
    python -m gradcomp.scale --table experiments/results/scale_model_<date>.md --plot ...

The model (every term is printed with the table):

- Step = compute + local work + communication, not overlapped (a bound: DDP overlaps part of the
  communication with the backward pass; gradcomp's hooks overlap the next bucket's compression
  with the current bucket's transfer, neither of which is modelled).
- Links: each node has one network link of ``gbps`` each way, shared by its L ranks (one network
  card per node: a commodity cluster; pass ``--nics-per-node L`` for a card per GPU), latency
  ``alpha_cross`` per message; inside a node ``intra_gbps`` per rank and ``alpha_intra``.
- Collectives over G ranks, bytes m per rank (ring / pairwise algorithms, bandwidth optimal):
  allreduce 2(G-1) alpha + 2 (G-1)/G m / beta; allgather (G-1) alpha + (G-1) m / beta; all-to-all
  (G-1) alpha + (G-1)/G m / beta. A flat collective over N nodes is limited by the node link: a
  ring crosses each node boundary once per direction (allreduce 2 (P-1)/P m, allgather (P-1) m
  per node link), an all-to-all sends L (P-L)/P m out of each node; every hop pays the
  cross-node alpha.
- A hierarchical plan: all-to-all (reduce-scatter) and allgather of the bucket at full precision
  over the L ranks of a node, then the family over N ranks on a shard of n / L elements, the L
  shards of a node sharing its link.
- Wire sizes per family: read from the plans themselves (plan_traffic: a dry run of each
  family's plan on simulated ranks at two bucket sizes and two world sizes, fitted per
  collective; headers, scales and padding included, fp32 gradients, NCCL's routes), so every
  registered family is in the model without a formula; PowerSGD alone by formula, rank r:
  (rows + cols) r 4 bytes per matrix and 4 per element of vectors (two allreduces, P and Q),
  since its traffic follows the model's matrix shapes.
- Local work: seconds per element of each family's compression (``--local``: measured here from
  the hooks, or GPU estimates from HBM bandwidth, see GPU_LOCAL), paid on n elements flat and
  n / L plus the full-precision reduce-scatter (one pass over the bucket) hierarchical.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# ------------------------------------------------------------------------------------------------
# models: (rows, cols) of each matrix, and the number of elements in vectors


def resnet50_shapes() -> Tuple[List[Tuple[int, int]], int]:
    """torchvision ResNet-50: conv weights as (out, in k k), fc; BatchNorm and biases as
    vectors (25,557,032 elements)."""
    mats, vec = [], 0

    def conv_bn(out, cin, k):
        nonlocal vec
        mats.append((out, cin * k * k))
        vec += 2 * out

    conv_bn(64, 3, 7)
    cin = 64
    for stage, blocks in enumerate((3, 4, 6, 3)):
        w = 64 << stage
        for b in range(blocks):
            conv_bn(w, cin, 1)
            conv_bn(w, w, 3)
            conv_bn(4 * w, w, 1)
            if b == 0:
                conv_bn(4 * w, cin, 1)
            cin = 4 * w
    mats.append((1000, 2048))
    vec += 1000
    return mats, vec


def gpt2_medium_shapes() -> Tuple[List[Tuple[int, int]], int]:
    """GPT-2 medium: 24 blocks of width 1024 (attention qkv and projection, MLP 4x), token and
    position embeddings; LayerNorms and biases as vectors (354,823,168 elements)."""
    d, layers, vocab, ctx = 1024, 24, 50257, 1024
    mats = [(vocab, d), (ctx, d)]
    vec = 0
    for _ in range(layers):
        mats += [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
        vec += 2 * d + 3 * d + d + 2 * d + 4 * d + d  # ln1, qkv bias, proj bias, ln2, fc, proj
    vec += 2 * d  # final LayerNorm
    return mats, vec


def mlp_shapes(width: int = 1024, layers: int = 6) -> Tuple[List[Tuple[int, int]], int]:
    """The DDP hooks benchmark's model: `layers` x Linear(width, width)."""
    return [(width, width)] * layers, width * layers


MODELS = {"resnet50": resnet50_shapes, "gpt2-medium": gpt2_medium_shapes, "mlp": mlp_shapes}

# Compute time of one step (forward + backward) per GPU, seconds: estimates, not measurements.
# ResNet-50, batch 256, mixed precision: ~3,000 images/s on an H100 -> 85 ms. GPT-2 medium,
# 8 x 1024 tokens: 6 x 355 M x 8192 = 1.7e13 FLOP at ~40% of an H100's ~1,000 TFLOP/s
# (bf16 dense) -> 45 ms.
GPU_COMPUTE_S = {"resnet50": 0.085, "gpt2-medium": 0.045}

# Seconds per gradient element of each family's local work on a GPU, estimated from HBM
# bandwidth (3.35 TB/s, an H100 SXM) and the bytes each kernel pass moves: top-k 4 passes over
# fp32 (residual update, sampled threshold, select, decode) = 16 B; 1-bit and quant 4 passes
# (error feedback, rotation, pack, unpack) = 16 B; PowerSGD 6 passes (two GEMMs over M, error,
# decompress) = 24 B; random-k 2 passes = 8 B; fp16 the cast both ways 6 B; allreduce none.
# Estimates until measured on a GPU (bench/gpu_bench.py measured 1-bit at 0.33 of copy
# bandwidth on an H200: these are optimistic by up to 3x for it).
HBM_BPS = 3.35e12
GPU_LOCAL = {"allreduce": 0.0, "fp16": 6 / HBM_BPS, "topk": 16 / HBM_BPS,
             "randomk": 8 / HBM_BPS, "onebit": 16 / HBM_BPS, "quant": 16 / HBM_BPS,
             "powersgd": 24 / HBM_BPS}
# the hierarchical plan's own pass: its reduce-scatter sums L blocks and its allgather copies
HIER_PASS_BYTES = 12


@dataclasses.dataclass
class Cluster:
    world: int
    per_node: int
    gbps: float                 # each node's link, each way (Gbit/s)
    alpha_cross: float = 20e-6  # seconds per message between nodes
    intra_gbps: float = 1200.0  # per rank inside a node (NVLink-class; PCIe ~ 200)
    alpha_intra: float = 5e-6
    nics_per_node: int = 1

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def node_bps(self) -> float:  # bytes per second of one node's links together
        return self.gbps * 1e9 / 8 * self.nics_per_node


@dataclasses.dataclass
class Family:
    name: str
    ratio: float = 0.01  # top-k, random-k
    bits: int = 4        # quant
    rank: int = 4        # PowerSGD

    @property
    def label(self) -> str:
        if self.name in ("topk", "randomk"):
            return f"{self.name} {self.ratio:g}"
        if self.name == "quant":
            return f"quant {self.bits}-bit"
        if self.name == "powersgd":
            return f"powersgd r{self.rank}"
        return self.name


def _allreduce(G, m, beta, alpha):
    return 0.0 if G <= 1 else 2 * (G - 1) * alpha + 2 * (G - 1) / G * m / beta


def _allgather(G, m, beta, alpha):
    return 0.0 if G <= 1 else (G - 1) * alpha + (G - 1) * m / beta


def _alltoall(G, m, beta, alpha):
    return 0.0 if G <= 1 else (G - 1) * alpha + (G - 1) / G * m / beta


# The traffic of every family but PowerSGD is read from its plans: a dry run of the plan's steps on
# simulated ranks in this process (gradcomp._C.dry_run), at two bucket sizes and two world sizes,
# fits each collective's bytes per rank as a + b n + (c + d n) / G (an allreduce, an allgather's
# own part: a chunk of 1/G of the bucket or a fixed-size payload) or a + b n + (c + d n) G (an
# all-to-all's P parts: the bucket plus a header per destination), which the four probes give
# exactly. So a new family, a header or a padding rule enters the model without a formula here.
# The backend is NCCL's (the cast plans' route then is one allreduce in the wire type).
PROBE_NUMEL = 16384  # elements of the smaller probe bucket (the larger: twice)
PROBE_WORLDS = (4, 8)
_WIRE_CACHE: Dict[Tuple, List[Tuple[str, Tuple[float, float, float, float]]]] = {}


def _plan_options(f: Family) -> dict:
    if f.name in ("topk", "randomk"):
        return {"ratio": f.ratio}
    if f.name == "quant":
        return {"bits": f.bits}
    return {}


def plan_traffic(f: Family) -> List[Tuple[str, Tuple[float, float, float, float]]]:
    """(kind, (a, b, c, d)) for each collective of one step of family f's plan, fitted from dry
    runs (see PROBE_NUMEL): bytes per rank = a + b n + (c + d n) / G, or times G for an
    all-to-all (whose bytes are all P parts a rank sends)."""
    key = (f.name, f.ratio, f.bits)
    if key in _WIRE_CACHE:
        return _WIRE_CACHE[key]
    from gradcomp import _C

    runs = {}
    for n in (PROBE_NUMEL, 2 * PROBE_NUMEL):
        for G in PROBE_WORLDS:
            runs[n, G] = [(c["kind"], float(c["send_bytes"]))
                          for c in _C.dry_run(f.name, n, G, options=_plan_options(f),
                                              backend="nccl")]
    kinds = [[k for k, _ in r] for r in runs.values()]
    if any(k != kinds[0] for k in kinds):
        raise ValueError(f"{f.label}: the plan's collectives differ between probe sizes "
                         f"({kinds}): its traffic is not affine in the bucket size")
    n1, n2 = PROBE_NUMEL, 2 * PROBE_NUMEL
    g1, g2 = PROBE_WORLDS
    out = []
    for i, kind in enumerate(kinds[0]):
        m = {nG: runs[nG][i][1] for nG in runs}
        # u = 1 / G (or G for an all-to-all): bytes = (a + c u) + (b + d u) n
        u1, u2 = ((g1, g2) if kind == "all-to-all" else (1 / g1, 1 / g2))
        slope1 = (m[n2, g1] - m[n1, g1]) / (n2 - n1)  # b + d u1
        slope2 = (m[n2, g2] - m[n1, g2]) / (n2 - n1)  # b + d u2
        d = (slope1 - slope2) / (u1 - u2)
        b = slope1 - d * u1
        icpt1, icpt2 = m[n1, g1] - slope1 * n1, m[n1, g2] - slope2 * n1  # a + c u
        c = (icpt1 - icpt2) / (u1 - u2)
        a = icpt1 - c * u1
        out.append((kind, (a, b, c, d)))
    _WIRE_CACHE[key] = out
    return out


def wire_bytes(kind: str, coef: Tuple[float, float, float, float], n: float, G: int) -> float:
    """Bytes per rank of one fitted collective (plan_traffic) for a bucket of n elements on G
    ranks."""
    a, b, c, d = coef
    u = G if kind == "all-to-all" else 1 / max(G, 1)
    return max(0.0, a + b * n + (c + d * n) * u)


def collectives(f: Family, mats: Sequence[Tuple[int, int]], vec: int, shard: int = 1,
                world: int = 8):
    """The collectives of one step of family f on the model (every matrix cut into `shard`
    row blocks, as the hierarchical plan's shards cut them) among `world` ranks: a list of
    (kind, bytes per rank), read from the plans (plan_traffic) but for PowerSGD's."""
    n = sum(r * c for r, c in mats) + vec
    nl = n / shard
    if f.name != "powersgd":
        return [(kind, wire_bytes(kind, coef, nl, world)) for kind, coef in plan_traffic(f)]
    # a shard holds rows / shard of each matrix and all its columns: P shrinks, Q does not
    p = sum(r / shard * f.rank for r, c in mats)
    q = sum(c * f.rank for r, c in mats)
    small = vec / shard
    return [("allreduce", 4 * (p + small)), ("allreduce", 4 * q)]


def comm_time(kind: str, m: float, G: int, c: Cluster, hier: bool) -> float:
    """Seconds for one collective of m bytes per rank over G ranks: among the N nodes (the L
    ranks of a node at once, sharing its link) for a hierarchical plan's cross-node part, or
    among all P ranks (flat)."""
    L, P, N = c.per_node, c.world, c.nodes
    bx, bi = c.node_bps(), c.intra_gbps * 1e9 / 8
    if hier:  # G = N ranks, L such groups share each node link
        share = L
        if kind == "allreduce":
            return _allreduce(G, m * share, bx, c.alpha_cross)
        if kind == "allgather":
            return _allgather(G, m * share, bx, c.alpha_cross)
        if kind == "all-to-all":
            return _alltoall(G, m * share, bx, c.alpha_cross)
        raise ValueError(kind)
    if N == 1:  # one node: everything inside it
        return {"allreduce": _allreduce, "allgather": _allgather,
                "all-to-all": _alltoall}[kind](P, m, bi, c.alpha_intra)
    # flat over nodes: the node link carries a ring's crossing traffic or the L ranks' off-node
    # share of an exchange; inside the node each rank's own traffic at intra speed
    if kind == "allreduce":
        cross, intra = 2 * (P - 1) / P * m, 2 * (P - 1) / P * m
        steps = 2 * (P - 1)
    elif kind == "allgather":
        cross, intra = (P - 1) * m, (P - 1) * m
        steps = P - 1
    elif kind == "all-to-all":
        cross, intra = L * (P - L) / P * m, (P - 1) / P * m
        steps = P - 1
    else:
        raise ValueError(kind)
    return steps * c.alpha_cross + max(cross / bx, intra / bi)


def step_time(f: Family, model: str, c: Cluster, hier: bool, compute_s: float,
              local_s_per_elem: Dict[str, float], shapes=None) -> Dict[str, float]:
    """Predicted seconds of one step: {"compute", "local", "intra", "cross", "total"}."""
    mats, vec = shapes if shapes is not None else MODELS[model]()
    n = sum(r * cc for r, cc in mats) + vec
    L, N = c.per_node, c.nodes
    hier = hier and L > 1
    out = {"compute": compute_s, "local": 0.0, "intra": 0.0, "cross": 0.0}
    if not hier:
        out["local"] = local_s_per_elem.get(f.name, 0.0) * n
        for kind, m in collectives(f, mats, vec, world=c.world):
            out["cross"] += comm_time(kind, m, c.world, c, hier=False)
    else:
        bi = c.intra_gbps * 1e9 / 8
        out["local"] = (local_s_per_elem.get(f.name, 0.0) * n / L
                        + local_s_per_elem.get("_hier_pass", HIER_PASS_BYTES / HBM_BPS) * n)
        out["intra"] = (_alltoall(L, 4 * n, bi, c.alpha_intra)
                        + _allgather(L, 4 * n / L, bi, c.alpha_intra))
        if N > 1:
            for kind, m in collectives(f, mats, vec, shard=L, world=N):
                out["cross"] += comm_time(kind, m, N, c, hier=True)
    out["total"] = sum(out.values())
    return out


DEFAULT_FAMILIES = [Family("allreduce"), Family("fp16"), Family("topk", ratio=0.001),
                    Family("topk", ratio=0.01), Family("onebit"), Family("quant", bits=4),
                    Family("powersgd", rank=4)]


def table(model: str, gbps_list: Iterable[float], worlds: Iterable[int], per_node: int,
          families: Sequence[Family] = DEFAULT_FAMILIES, compute_s: Optional[float] = None,
          local: Optional[Dict[str, float]] = None, **cluster_kw) -> List[dict]:
    """Rows of predicted step times and speedups over plain DDP (flat fp32 allreduce)."""
    compute_s = GPU_COMPUTE_S[model] if compute_s is None else compute_s
    local = GPU_LOCAL if local is None else local
    rows = []
    for gbps in gbps_list:
        for P in worlds:
            c = Cluster(P, per_node, gbps, **cluster_kw)
            base = step_time(Family("allreduce"), model, c, False, compute_s, local)["total"]
            for f in families:
                for hier in (False, True):
                    t = step_time(f, model, c, hier, compute_s, local)
                    rows.append({"model": model, "gbps": gbps, "world": P, "family": f.label,
                                 "hier": hier, "step_s": t["total"], "speedup": base / t["total"],
                                 **{k: t[k] for k in ("compute", "local", "intra", "cross")}})
    return rows


def format_table(rows: List[dict]) -> str:
    """Markdown: per model and bandwidth, speedup over plain DDP (flat / hierarchical) by world."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for gbps in dict.fromkeys(r["gbps"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["gbps"] == gbps]
            worlds = sorted(set(r["world"] for r in rs))
            fams = list(dict.fromkeys(r["family"] for r in rs))
            base = {r["world"]: r["step_s"] for r in rs
                    if r["family"] == "allreduce" and not r["hier"]}
            out.append(f"\n### {model}, {gbps:g} Gbit/s between nodes\n")
            out.append("Plain DDP step (ms): " + ", ".join(
                f"{P}: {1e3 * base[P]:.0f}" for P in worlds) + "\n")
            out.append("| family | " + " | ".join(f"P={P}" for P in worlds) + " |")
            out.append("|---|" + "---|" * len(worlds))
            for fam in fams:
                cells = []
                for P in worlds:
                    flat = next(r for r in rs if r["family"] == fam and r["world"] == P
                                and not r["hier"])
                    hier = next(r for r in rs if r["family"] == fam and r["world"] == P
                                and r["hier"])
                    cells.append(f"{flat['speedup']:.2f} / {hier['speedup']:.2f}")
                out.append(f"| {fam} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    bws = list(dict.fromkeys(r["gbps"] for r in rows))
    fig, axes = plt.subplots(len(models), len(bws), figsize=(5.5 * len(bws), 4.2 * len(models)),
                             squeeze=False, sharex=True)
    fams = list(dict.fromkeys(r["family"] for r in rows))
    colors = dict(zip(fams, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for i, model in enumerate(models):
        for j, gbps in enumerate(bws):
            ax = axes[i][j]
            for fam in fams:
                for hier, style in ((False, "--"), (True, "-")):
                    rs = sorted((r for r in rows if r["model"] == model and r["gbps"] == gbps
                                 and r["family"] == fam and r["hier"] == hier),
                                key=lambda r: r["world"])
                    ax.plot([r["world"] for r in rs], [r["speedup"] for r in rs], style,
                            color=colors[fam], marker="o" if hier else None, markersize=3,
                            label=f"{fam}{' (hierarchical)' if hier else ''}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_title(f"{model}, {gbps:g} Gbit/s per node")
            ax.set_xlabel("GPUs (8 per node)")
            ax.set_ylabel("predicted speedup over plain DDP")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Scale model (estimates): dashed flat, solid hierarchical; "
                 "GPU kernel and compute costs estimated, not measured", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# calibration on measured runs (experiments/ddp_hooks_bench.py CSV files)


def family_of(config: str) -> Tuple[Optional[Family], bool]:
    """The family and hierarchy of a DDP hooks benchmark configuration ("ours-topk-0.001-hier"):
    (None, False) for the floors and PyTorch's hooks; "ddp" is the flat allreduce."""
    hier = config.endswith("-hier")
    name = config[:-len("-hier")] if hier else config
    if name == "ddp":
        return Family("allreduce"), False
    if not name.startswith("ours-"):
        return None, False
    parts = name[len("ours-"):].split("-")
    fam = parts[0]
    if fam in ("topk", "randomk") and len(parts) == 2:
        return Family(fam, ratio=float(parts[1])), hier
    if fam == "quant" and len(parts) == 2:
        return Family(fam, bits=int(parts[1])), hier
    if fam == "powersgd" and len(parts) == 2 and parts[1].startswith("r"):
        return Family(fam, rank=int(parts[1][1:])), hier
    if fam in ("allreduce", "fp16", "onebit") and len(parts) == 1:
        return Family(fam), hier
    return None, False


def read_runs(paths: Dict[Tuple[int, int], str]) -> Dict[Tuple[int, int], Dict[str, dict]]:
    """{(world, per_node): {config: row}} from the benchmark's CSV files."""
    import csv
    out = {}
    for key, path in paths.items():
        with open(path) as f:
            out[key] = {r["config"]: r for r in csv.DictReader(f)}
    return out


def calibrate(runs: Dict[Tuple[int, int], Dict[str, dict]], shapes, base_world: int = 2):
    """Fits the model to measured runs of the MLP on the emulated cluster and predicts each
    measured configuration. Returns (parameters, rows of measured vs predicted).

    - compute: each run's own no-comm step (the compute floor: on a 2-core machine it grows with
      the ranks that share the cores);
    - local work: each family's hook-measured local seconds per element in the flat run of
      `base_world` ranks, scaled by the run's compute floor over that run's (the same cores
      shared by more ranks); the hierarchical plan's own pass (its reduce-scatter sum and copies)
      from the hierarchical plain allreduce's local time less its inner allreduce's;
    - links: alpha and beta between nodes by least squares on the flat plain allreduce
      (ours-allreduce) of every flat run; inside a node (loopback) beta from the hierarchical
      plain allreduce's remaining time (one run: it is then predicted exactly, the other
      families are the check).
    """
    mats, vec = shapes
    n = sum(r * c for r, c in mats) + vec
    floor = {k: float(v["no-comm"]["median_ms"]) / 1e3 for k, v in runs.items() if "no-comm" in v}
    base = runs[(base_world, 1)]
    local = {}
    for cfg, r in base.items():
        f, hier = family_of(cfg)
        if f is not None and not hier and r.get("hook_local_ms"):
            local[f.label] = float(r["hook_local_ms"]) / 1e3 / n / floor[(base_world, 1)]
    # cross-node link: t = compute + local + 2(P-1) alpha + 2(P-1)/P m / beta, m = 4 n
    xs, ys = [], []
    for (P, L), rows in runs.items():
        if L != 1 or "ours-allreduce" not in rows or P < 2:
            continue
        r = rows["ours-allreduce"]
        comm = (float(r["median_ms"]) / 1e3 - floor[(P, L)]
                - float(r["hook_local_ms"] or 0) / 1e3)
        xs.append((2 * (P - 1), 2 * (P - 1) / P * 4 * n))
        ys.append(comm)
    # least squares for (alpha, 1/beta)
    saa = sum(a * a for a, _ in xs)
    sab = sum(a * b for a, b in xs)
    sbb = sum(b * b for _, b in xs)
    sya = sum(y * a for y, (a, _) in zip(ys, xs))
    syb = sum(y * b for y, (_, b) in zip(ys, xs))
    det = saa * sbb - sab * sab
    alpha = (sya * sbb - syb * sab) / det
    inv_beta = (saa * syb - sab * sya) / det
    if alpha < 0:  # latency below what the fit resolves: bandwidth alone
        alpha, inv_beta = 0.0, syb / sbb
    gbps = 8 / inv_beta / 1e9
    params = {"alpha_cross_s": alpha, "gbps": gbps, "local_s_per_elem_at_base": local,
              "compute_s": floor}
    # inside a node: from the hierarchical plain allreduce
    hier_runs = [k for k in runs if k[1] > 1]
    intra_gbps, hier_pass = 1e9, 0.0
    for key in hier_runs:
        rows = runs[key]
        if "ours-allreduce-hier" not in rows:
            continue
        P, L = key
        c = Cluster(P, L, gbps, alpha_cross=alpha)
        r = rows["ours-allreduce-hier"]
        flat_local = local.get("allreduce", 0.0) * floor[key] * n / L
        hier_pass = max(0.0, (float(r["hook_local_ms"]) / 1e3 - flat_local) / n / floor[key])
        cross = sum(comm_time(k, m, P // L, c, hier=True)
                    for k, m in collectives(Family("allreduce"), mats, vec, shard=L, world=P // L))
        intra = float(r["median_ms"]) / 1e3 - floor[key] - float(r["hook_local_ms"]) / 1e3 - cross
        moved = (L - 1) / L * 4 * n + (L - 1) * 4 * n / L  # all-to-all + allgather per rank
        intra_gbps = 8 * moved / max(intra, 1e-9) / 1e9
    params.update(intra_gbps=intra_gbps, hier_pass_s_per_elem_at_base=hier_pass)
    out = []
    for (P, L), rows in sorted(runs.items()):
        for cfg, r in rows.items():
            f, hier = family_of(cfg)
            if f is None:
                continue
            c = Cluster(P, L, gbps, alpha_cross=alpha, intra_gbps=intra_gbps, alpha_intra=0.0)
            scale = floor[(P, L)]
            per_elem = {f.name: local.get(f.label, 0.0) * scale, "_hier_pass": hier_pass * scale}
            t = step_time(f, "mlp", c, hier, floor[(P, L)], per_elem, shapes=shapes)
            measured = float(r["median_ms"]) / 1e3
            out.append({"world": P, "per_node": L, "config": cfg, "measured_s": measured,
                        "predicted_s": t["total"], "error": t["total"] / measured - 1,
                        **{k: t[k] for k in ("compute", "local", "intra", "cross")}})
    return params, out


def format_calibration(params: dict, rows: List[dict]) -> str:
    """Markdown: the fitted parameters and every run's measured and predicted step time."""
    out = ["Fitted: between nodes alpha {:.3f} ms per message, {:.3f} Gbit/s per node link; inside "
           "a node {:.2f} Gbit/s per rank (loopback); compute floors (no-comm) {}.".format(
               1e3 * params["alpha_cross_s"], params["gbps"], params["intra_gbps"],
               ", ".join(f"{P}x{L}: {1e3 * t:.1f} ms"
                         for (P, L), t in sorted(params["compute_s"].items()))),
           "",
           "| ranks | config | measured ms | predicted ms | error | compute | local | inside node "
           "| between nodes |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['world']} ({r['world'] // r['per_node']} x {r['per_node']}) | "
                   f"{r['config']} | {1e3 * r['measured_s']:.1f} | {1e3 * r['predicted_s']:.1f} | "
                   f"{100 * r['error']:+.1f}% | {1e3 * r['compute']:.1f} | {1e3 * r['local']:.1f} | "
                   f"{1e3 * r['intra']:.1f} | {1e3 * r['cross']:.1f} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.2 for r in rows)
    out.append("")
    out.append(f"{within} of {len(rows)} within 20%; the largest error {100 * worst['error']:+.1f}% "
               f"({worst['config']}, {worst['world']} ranks as "
               f"{worst['world'] // worst['per_node']} x {worst['per_node']}).")
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradcomp.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["resnet50", "gpt2-medium"],
                    choices=sorted(MODELS))
    ap.add_argument("--gbps", nargs="+", type=float, default=[10.0, 100.0],
                    help="each node's link to the others, Gbit/s each way")
    ap.add_argument("--world", nargs="+", type=int,
                    default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--nics-per-node", type=int, default=1)
    ap.add_argument("--alpha-us", type=float, default=20.0, help="latency between nodes (us)")
    ap.add_argument("--intra-gbps", type=float, default=1200.0,
                    help="per rank inside a node (NVLink-class 1200, PCIe ~200)")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="compute per step (default: the estimate for the model)")
    ap.add_argument("--calibrate", nargs="+", default=[], metavar="PxL=CSV",
                    help="fit and check the model on DDP hooks benchmark runs of the MLP "
                         "(experiments/ddp_hooks_bench.py CSV files; P ranks in nodes of L): "
                         "prints measured against predicted step times, then exits")
    ap.add_argument("--mlp", default="1024x6", help="the benchmark MLP of --calibrate: WxLAYERS")
    ap.add_argument("--table", default="", help="write the markdown table here")
    ap.add_argument("--plot", default="", help="write the plot here (png)")
    a = ap.parse_args(argv)
    if a.calibrate:
        paths = {}
        for spec in a.calibrate:
            key, _, path = spec.partition("=")
            P, _, L = key.partition("x")
            if not (P.isdigit() and L.isdigit() and path):
                ap.error(f"--calibrate takes PxL=CSV, got {spec!r}")
            paths[(int(P), int(L))] = path
        width, _, layers = a.mlp.partition("x")
        params, rows = calibrate(read_runs(paths), mlp_shapes(int(width), int(layers)))
        text = format_calibration(params, rows)
        print(text)
        if a.table:
            with open(a.table, "w") as f:
                f.write(text)
        return 0
    for P in a.world:
        if P % a.per_node:
            ap.error(f"--per-node {a.per_node} does not divide world {P}")
    rows = []
    for model in a.model:
        rows += table(model, a.gbps, a.world, a.per_node,
                      compute_s=None if a.compute_ms is None else a.compute_ms / 1e3,
                      alpha_cross=a.alpha_us * 1e-6, intra_gbps=a.intra_gbps,
                      nics_per_node=a.nics_per_node)
    text = format_table(rows)
    print("Predicted speedup over plain DDP, flat / hierarchical (estimates: GPU compute and "
          "kernel costs from HBM bandwidth, not measured)" + text)
    if a.table:
        with open(a.table, "w") as f:
            f.write(text)
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
