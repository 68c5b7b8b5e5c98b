# SPDX-License-Identifier: Apache-2.0
"""The Fashion-MNIST experiment's report: time to a target accuracy, the summary table, the
plots and the results folder (results.jsonl, steps.csv, evals.csv, table.md)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

# ---- report ------------------------------------------------------------------------------------
#: PyTorch's hook of the same kind, for the "vs PyTorch" column
COUNTERPART = {"fp16": "torch-fp16", "powersgd": "torch-powersgd"}


#: evaluations averaged by the smoothed time to target
SMOOTH_EVALS = 3


def time_to_target(r: Dict[str, Any], target: float, window: int = 1) -> Optional[float]:
    """Seconds of training until the mean test accuracy of an evaluation and the `window` - 1
    before it is at or above `target`, or None. window=1: the first evaluation at or above it,
    which moves by a whole evaluation interval when a noisy curve grazes the target;
    window=SMOOTH_EVALS asks that the accuracy stay there on average."""
    accs = [acc for _, _, acc in r["accuracy_log"]]
    for i, (_, t, _) in enumerate(r["accuracy_log"]):
        if i + 1 >= window and sum(accs[i + 1 - window:i + 1]) / window >= target:
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
        tts = [time_to_target(r, target, SMOOTH_EVALS) for r in rs]
        rows.append({
            "config": cfg, "seeds": [r["seed"] for r in rs],
            "accuracy": _mean([r["accuracy"] for r in rs]),
            "accuracies": [r["accuracy"] for r in rs],
            "epochs": rs[0]["steps"] / rs[0]["steps_per_epoch"],
            "train_s": _mean([r["wall_s"] for r in rs]),
            "step_s": _mean([r["wall_s"] / max(1, r["steps"]) for r in rs]),
            "time_to_target": None if None in ttt else _mean(ttt),
            "time_to_target_smoothed": None if None in tts else _mean(tts),
            "wire_bytes": _mean([r["wire_bytes_per_step"] for r in rs]),
            "plain_wire_bytes": rs[0]["plain_wire_bytes_per_step"],
            "samples_fraction": _mean([r.get("samples_fraction", 1.0) for r in rs]),
        })
    t = {row["config"]: row["time_to_target"] for row in rows}
    ts = {row["config"]: row["time_to_target_smoothed"] for row in rows}
    for row in rows:
        mine = row["time_to_target_smoothed"]
        row["speedup_vs_plain_smoothed"] = (ts.get("plain") / mine
                                            if ts.get("plain") and mine else None)
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
            "vs no DropCompute | step time | wire bytes/step | fewer bytes than plain | "
            f"time to {100 * target:.0f}%, {SMOOTH_EVALS}-evaluation mean | its speedup vs plain |")
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
            f"{_fmt(r['plain_wire_bytes'] / wb if wb else None, '.1f')}{'x' if wb else ''} | "
            f"{_fmt(r['time_to_target_smoothed'], '.0f', 'not reached')}"
            f"{'' if r['time_to_target_smoothed'] is None else ' s'} | "
            f"{_fmt(r['speedup_vs_plain_smoothed'], '.2f')}"
            f"{'x' if r['speedup_vs_plain_smoothed'] else ''} |")
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


def git_output(*a) -> str:
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
        if meta.get("optimizer") == "adamw":
            opt = (f"AdamW lr {meta['lr']} (betas 0.9, 0.999; decoupled weight decay "
                   f"{meta.get('weight_decay')}), linear warm-up over {meta.get('warmup_steps')} "
                   "steps, cosine decay to 0 (`onebit-adam`: gradcomp's OneBitAdam, the same "
                   "schedule; `local-*` and `qsr:*`: Local AdamW, no DDP, replicas averaged by "
                   "QSRAverager)")
        else:
            opt = (f"SGD lr {meta['lr']}, momentum {meta['momentum']} (in the hook with "
                   "`dgc_optimizer` for top-k, random-k with correction and 1-bit momentum)")
        f.write(f"- Setting: {opt}, batch "
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
    """The setting (model, world, link, lr, momentum, batch, eval_every, optimizer, weight decay,
    warm-up, commit) the runs recorded: a value
    shared by every run; "mixed: a / b" where they differ. A key no run recorded (runs from before
    it was recorded) takes ``fallback``'s value (the command's own options), if any."""
    out: Dict[str, Any] = {}
    for k in ("model", "world", "link", "lr", "momentum", "batch", "eval_every", "optimizer",
              "weight_decay", "warmup_steps", "commit"):
        vals = sorted({json.dumps(r[k]) for r in results if k in r})
        if len(vals) == 1:
            out[k] = json.loads(vals[0])
        elif vals:
            out[k] = "mixed: " + " / ".join(str(json.loads(v)) for v in vals)
        elif fallback.get(k) is not None:
            out[k] = fallback[k]
    return out
