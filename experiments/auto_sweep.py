# SPDX-License-Identifier: Apache-2.0
"""Is ``hook("auto")`` ever slower than plain DDP? A sweep over link rate x added round-trip
latency x model x world size, each setting one interleaved run of every method.

Each setting is one run of ``python -m experiments.ddp_hooks_bench --set sweep`` (plain DDP, its
compute floor, PyTorch's fp16 and PowerSGD hooks, auto with its defaults, every compressing
family of ours at its documented defaults), every rank in its own network namespace with links
of the setting's rate (tbf) and the latency added by the ``gloo_latency`` process group (one-way
latency = RTT / 2 per message round of each collective; this kernel has no netem:
experiments.latency, checked against the alpha-beta model in
experiments/results/latency_check_2026-11-28). Plain DDP and PyTorch's hooks go through the same
group, so every method pays the same latency per round.

Resumable and bounded: every finished setting is a JSON file in the output folder and is not
run again; a setting that fails is recorded (``failed.jsonl``) and retried by the next
invocation; no new setting starts once ``--budget-min`` is spent, and each is bounded by
``--setting-timeout``. ``--report`` writes the table and heatmaps from what is there.

    sudo .venv-torch2/bin/python -m experiments.auto_sweep --out experiments/results/auto_sweep
    .venv-torch2/bin/python -m experiments.auto_sweep --report experiments/results/auto_sweep

Needs root (namespaces) and torch 2.x (the latency group).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RATES = ("100mbit", "1gbit", "10gbit", "40gbit")
RTTS_MS = (0.1, 5.0, 50.0)
MODELS = ("mlp", "cnn", "vit")
WORLDS = (2, 4)
#: methods whose speed the report compares auto with ("best": the fastest of these); no-comm is
#: the compute floor, not a method
METHODS = ("ddp", "torch-fp16", "torch-powersgd", "auto", "fp16", "bf16", "quant", "powersgd",
           "topk", "randomk", "onebit", "fp8")
#: auto's mechanism under A/B (``--methods``): the earlier decision rule (no step_margin), fp8
#: among the candidates, quant by each of its routes, auto without fp16's ring route (its
#: candidate list before that route), auto with the mean of the ranks' costs (the rule before
#: each step's least over the ranks), auto and PowerSGD with every small allreduce on gloo's
#: ring, auto with step_margin a share of the whole trial's median step (the rule before the
#: fastest candidate's step), auto with 2 measured trial steps a candidate (the default before
#: 3); not counted as methods a user picks ("best")
AB_METHODS = ("auto-step0", "auto-fp8", "quant-2phase", "quant-gather", "auto-noring",
              "auto-meancost", "auto-ringsums", "powersgd-ringsums", "auto-trialstep",
              "auto-trial3")
#: the families whose accuracy needs DGC's momentum correction (docs/CHOOSING.md): not among
#: auto's default candidates, so the report also measures auto against the best of the others
NEEDS_DGC = ("topk", "randomk", "onebit")
#: the 6.3M-parameter MLP: 6 x Linear(1024, 1024)
MLP = dict(width=1024, layers=6)


def setting_key(model: str, world: int, rate: str, rtt_ms: float) -> str:
    return f"{model}_w{world}_{rate}_rtt{rtt_ms:g}ms"


def settings(models, worlds, rates, rtts) -> List[Dict[str, Any]]:
    """Every combination, the fastest links first (the cheap settings: a budget cut short
    leaves the slowest link's settings for the next invocation, each model and world size
    covered at every rate run so far)."""
    out = []
    for rate in sorted(rates, key=lambda r: -_rate_bits(r)):
        for rtt, world, model in itertools.product(rtts, worlds, models):
            out.append(dict(model=model, world=world, rate=rate, rtt_ms=rtt,
                            key=setting_key(model, world, rate, rtt)))
    return out


def _rate_bits(rate: str) -> float:
    """tc's rate syntax as bits/s (100mbit, 1gbit, 40gbit)."""
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: a number with kbit, mbit or gbit")


def bench_command(s: Dict[str, Any], a) -> List[str]:
    cmd = [sys.executable, "-m", "experiments.ddp_hooks_bench", "--set", "sweep",
           "--model", s["model"], "--world", str(s["world"]), "--netns", s["rate"],
           "--delay", f"{s['rtt_ms'] / 2:g}ms",
           "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--batch", str(a.batch), "--bucket-cap-mb", "25",
           "--only", ",".join(("no-comm",) + tuple(a.methods)),
           "--timeout", str(a.setting_timeout)]
    if s["model"] == "mlp":
        cmd += ["--width", str(MLP["width"]), "--layers", str(MLP["layers"])]
    return cmd


def run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    todo = settings(a.models, a.worlds, a.rates, a.rtts)
    t0 = time.time()
    done = skipped = 0
    for s in todo:
        path = os.path.join(a.out, s["key"] + ".json")
        if os.path.exists(path):
            skipped += 1
            continue
        spent = (time.time() - t0) / 60
        if spent >= a.budget_min:
            print(f"sweep: budget of {a.budget_min:g} min spent; {len(todo) - done - skipped} "
                  f"settings left for the next invocation", flush=True)
            break
        cmd = bench_command(s, a) + ["--json", path]
        print(f"sweep: {s['key']} ({spent:.1f} min spent)", flush=True)
        t1 = time.time()
        try:
            # the bench bounds its ranks by --timeout; this bounds the bench itself
            r = subprocess.run(cmd, cwd=ROOT, timeout=a.setting_timeout + 120,
                               capture_output=True, text=True)
            ok = r.returncode == 0 and os.path.exists(path)
            err = "" if ok else (r.stderr or r.stdout)[-2000:]
        except subprocess.TimeoutExpired:
            ok, err = False, f"timed out after {a.setting_timeout + 120:g} s"
        if ok:
            done += 1
            print(f"sweep: {s['key']} done in {time.time() - t1:.0f} s", flush=True)
        else:
            with open(os.path.join(a.out, "failed.jsonl"), "a") as f:
                f.write(json.dumps({"key": s["key"], "at": _now(), "error": err}) + "\n")
            print(f"sweep: {s['key']} FAILED: {err[-400:]}", flush=True)
    print(f"sweep: {done} run now, {skipped} already there, {(time.time() - t0) / 60:.1f} min",
          flush=True)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------- report
def _speed(row) -> Dict[str, float]:
    """steps/s from the median of the rounds' median step times, and the rounds' range."""
    rounds = row["all_rounds"]
    return {"sps": 1.0 / statistics.median(rounds), "lo": 1.0 / max(rounds),
            "hi": 1.0 / min(rounds)}


def analyse(run: Dict[str, Any], rtt_ms: Optional[float] = None) -> Dict[str, Any]:
    """One setting's figures: auto against plain DDP, the best method and PyTorch's hooks.

    With the setting's added round trip `rtt_ms`, also the bound on what any method that
    exchanges once per step can reach (``bound``, as a multiple of plain DDP's steps/s): its
    step cannot be shorter than the compute floor plus one one-way latency, since the last
    bucket's gradient exists only when backward ends and has to reach the other ranks before
    they can step (more buckets overlap the others' rounds with backward, not that one). The
    bound is no tighter than the floor's own spread over rounds."""
    rows = {r["name"]: r for r in run["rows"]}
    sp = {n: _speed(r) for n, r in rows.items()}
    ddp, auto = sp["ddp"], sp["auto"]
    methods = [m for m in METHODS if m in sp]
    best = max(methods, key=lambda m: sp[m]["sps"])
    plain_acc = [m for m in methods if m not in NEEDS_DGC]
    best_plain = max(plain_acc, key=lambda m: sp[m]["sps"])
    floor = rows.get("no-comm")
    share = (1.0 - statistics.median(floor["all_rounds"]) / statistics.median(rows["ddp"]["all_rounds"])
             if floor else None)
    vs_ddp = auto["sps"] / ddp["sps"]
    bound = None
    if floor and rtt_ms is not None:
        bound = (statistics.median(rows["ddp"]["all_rounds"])
                 / (statistics.median(floor["all_rounds"]) + rtt_ms / 2e3))
    # a loss counts when auto is below 0.95x plain DDP and the rounds do not overlap: auto's
    # fastest round slower than plain DDP's slowest
    loss = vs_ddp < 0.95 and auto["hi"] < ddp["lo"]
    # below one of PyTorch's hooks beyond the rounds' spread: auto's fastest round slower than
    # the hook's slowest (the same reading as a loss against plain DDP, without the 5% margin)
    behind = [h for h in ("torch-fp16", "torch-powersgd")
              if h in sp and auto["sps"] < sp[h]["sps"] and auto["hi"] < sp[h]["lo"]]
    return {"ddp_sps": ddp["sps"], "auto_sps": auto["sps"], "vs_ddp": vs_ddp,
            "vs_ddp_lo": auto["lo"] / ddp["hi"], "vs_ddp_hi": auto["hi"] / ddp["lo"],
            "loss": loss, "comm_share": share, "bound": bound,
            "vs_bound": None if bound is None else vs_ddp / bound, "best": best, "best_vs_ddp": sp[best]["sps"] / ddp["sps"],
            "vs_best": auto["sps"] / sp[best]["sps"],
            "best_plain": best_plain, "vs_best_plain": auto["sps"] / sp[best_plain]["sps"],
            "vs_torch_fp16": auto["sps"] / sp["torch-fp16"]["sps"] if "torch-fp16" in sp else None,
            "vs_torch_powersgd": (auto["sps"] / sp["torch-powersgd"]["sps"]
                                  if "torch-powersgd" in sp else None),
            "behind": behind, "choices": rows["auto"].get("choices"),
            "ab_choices": {m: rows[m].get("choices") for m in AB_METHODS
                           if m in rows and m.startswith("auto")},  # (what auto's variants chose)
            # what auto and each variant chose in every round (each round runs its own trial):
            # rounds that disagree are a trial deciding by its noise
            "round_choices": {m: [t["choices"] for t in rows[m].get("all_trials") or [] if t]
                              for m in ("auto", *AB_METHODS)
                              if m in rows and m.startswith("auto")},
            "speeds": {m: sp[m]["sps"] / ddp["sps"] for m in (*methods, *AB_METHODS) if m in sp}}


def load(folder: str, also: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Every finished setting in `folder`, then in each of the `also` folders in turn for the
    settings `folder` does not have (one table from sweeps run in parts); each setting says
    which folder it came from (``folder``)."""
    out = []
    for s in sorted(settings(MODELS, WORLDS, RATES, RTTS_MS),
                    key=lambda s: (MODELS.index(s["model"]), s["world"], RATES.index(s["rate"]),
                                   s["rtt_ms"])):
        for where in (folder, *also):
            path = os.path.join(where, s["key"] + ".json")
            if os.path.exists(path):
                with open(path) as f:
                    run = json.load(f)
                out.append(dict(s, run=run, folder=where, **analyse(run, s["rtt_ms"])))
                break
    return out


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _choices_text(ch) -> str:
    if not ch:
        return "-"
    return ", ".join(f"{k}:{v}" for k, v in sorted(ch.items(), key=lambda kv: int(kv[0])))


def report(folder: str, also: Sequence[str] = ()) -> str:
    res = load(folder, also)
    if not res:
        raise SystemExit(f"no finished setting in {folder}")
    lines = []
    metas = [r["run"]["meta"] for r in res]
    commits = sorted({m["commit"] + (" (dirty)" if m["dirty"] else "") for m in metas})
    lines.append("# auto against plain DDP, PyTorch's hooks and every family: the sweep\n")
    lines.append(f"- {len(res)} of {len(MODELS) * len(WORLDS) * len(RATES) * len(RTTS_MS)} "
                 f"settings. Runs {min(m['date'] for m in metas)} to {max(m['date'] for m in metas)} "
                 f"(UTC), commits {', '.join(commits)}, torch {metas[0]['torch']}, "
                 f"{metas[0]['cpus']}-core VM; 1-minute load average during the runs: "
                 f"{min(m['load_min'] for m in metas):.2f} to {max(m['load_max'] for m in metas):.2f}.")
    lines.append(f"- Command: `sudo .venv-torch2/bin/python -m experiments.auto_sweep --out "
                 f"{os.path.relpath(folder, ROOT)}`; each setting's file names its exact bench "
                 f"command (`meta.command`).")
    if also:
        parts = []
        for where in (folder, *also):
            mine = [r for r in res if r["folder"] == where]
            if mine:
                cs = sorted({r["run"]["meta"]["commit"] for r in mine})
                parts.append(f"{len(mine)} from `{os.path.relpath(where, ROOT)}` "
                             f"({', '.join(cs)})")
        lines.append(f"- Settings from several runs: {'; '.join(parts)}.")
    lines.append("- Speeds: steps/s = 1 / (median over rounds of each round's median step time), "
                 "a step's time being the slowest rank's; ratios against plain DDP in the same "
                 "run. [lo, hi]: the ratio's range over the rounds (auto's slowest round against "
                 "DDP's fastest, and the reverse). A loss: below 0.95x and the ranges apart.")
    lines.append("- comm share: 1 - (compute floor, DDP with a hook that communicates nothing) / "
                 "(plain DDP step).")
    lines.append("- bound: plain DDP's step / (compute floor + RTT / 2), the most any method that "
                 "exchanges once per step can reach (x DDP): the last bucket is ready only when "
                 "backward ends, and its exchange takes at least one one-way latency. An "
                 "estimate from measured medians, so a method can land a little above it.\n")
    hdr = ["model", "ranks", "link", "RTT ms", "DDP steps/s", "comm share", "bound (x DDP)",
           "auto/DDP [lo, hi]",
           "best (x DDP)", "auto/best", "auto/best without DGC families", "auto/torch-fp16",
           "auto/torch-PowerSGD",
           "auto chose (bucket:candidate)"]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    for r in res:
        share = "-" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%"
        lines.append("| " + " | ".join([
            r["model"], str(r["world"]), r["rate"], f"{r['rtt_ms']:g}", f"{r['ddp_sps']:.2f}",
            share, "-" if r["bound"] is None else f"{r['bound']:.2f}",
            f"{r['vs_ddp']:.2f} [{r['vs_ddp_lo']:.2f}, {r['vs_ddp_hi']:.2f}]"
            + (" LOSS" if r["loss"] else ""),
            f"{r['best']} ({r['best_vs_ddp']:.2f})", f"{r['vs_best']:.2f}",
            f"{r['vs_best_plain']:.2f} ({r['best_plain']})",
            _ratio(r["vs_torch_fp16"]), _ratio(r["vs_torch_powersgd"]),
            _choices_text(r["choices"])]) + " |")
    # targets
    n = len(res)
    losses = [r for r in res if r["loss"]]
    heavy = [r for r in res if r["comm_share"] is not None and r["comm_share"] >= 0.6]
    lines.append("\n## Against the targets\n")
    lines.append(f"- auto >= 0.95x plain DDP: {n - len(losses)} of {n} settings"
                 + (f" (losses: {', '.join(r['key'] for r in losses)})" if losses else "")
                 + f"; lowest ratio {min(r['vs_ddp'] for r in res):.2f}.")
    if heavy:
        capped = [r for r in heavy if r["bound"] is not None and r["bound"] < 2]
        open_ = [r for r in heavy if r not in capped]
        line = (f"- Where plain DDP spends >= 60% of its step communicating ({len(heavy)} "
                f"settings): auto >= 2x in {sum(r['vs_ddp'] >= 2 for r in heavy)}; range "
                f"{min(r['vs_ddp'] for r in heavy):.2f}-{max(r['vs_ddp'] for r in heavy):.2f}x.")
        if capped:
            line += (f" In {len(capped)} of them the bound is below 2x, so no method that "
                     f"exchanges once per step can reach 2x there ("
                     + ", ".join(f"{r['key']} {r['bound']:.2f}x" for r in capped) + ")")
            line += (f"; in the other {len(open_)}: auto >= 2x in "
                     f"{sum(r['vs_ddp'] >= 2 for r in open_)}." if open_ else ".")
        lines.append(line)
    lines.append(f"- auto within 10% of the best method: {sum(r['vs_best'] >= 1 / 1.1 for r in res)} "
                 f"of {n}; of the best method without the families that need DGC's momentum "
                 f"correction ({', '.join(NEEDS_DGC)}; not auto's default candidates): "
                 f"{sum(r['vs_best_plain'] >= 1 / 1.1 for r in res)} of {n}.")
    for hook, field, name in (("torch-fp16", "vs_torch_fp16", "fp16"),
                              ("torch-powersgd", "vs_torch_powersgd", "PowerSGD")):
        if all(r[field] is None for r in res):
            continue
        below = [f"{r['key']} {r[field]:.2f}" for r in res if hook in r["behind"]]
        lines.append(f"- auto >= PyTorch's {name} hook: "
                     f"{sum(r[field] is not None and r[field] >= 1 for r in res)} of {n}; "
                     f"below it beyond the rounds' spread: {len(below)}"
                     + (f" ({', '.join(below)})" if below else "") + ".")
    lines.append("\n## Every method against plain DDP (steps/s ratio)\n")
    shown = [m for m in (*METHODS[1:], *AB_METHODS) if any(m in r["speeds"] for r in res)]
    hdr = ["setting"] + shown
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    for r in res:
        lines.append("| " + " | ".join([r["key"]] + [
            f"{r['speeds'][m]:.2f}" if m in r["speeds"] else "-" for m in shown]) + " |")
    ab = [r for r in res if r["ab_choices"]]
    if ab:
        lines.append("\n## What the A/B variants of auto chose (bucket:candidate)\n")
        names = [m for m in AB_METHODS if any(m in r["ab_choices"] for r in ab)]
        lines.append("| setting | auto | " + " | ".join(names) + " |")
        lines.append("|" + "---|" * (len(names) + 2))
        for r in ab:
            lines.append("| " + " | ".join([r["key"], _choices_text(r["choices"])] + [
                _choices_text(r["ab_choices"].get(m)) for m in names]) + " |")
        # every round's choice, and how often a setting's rounds agreed
        rc = [r for r in ab if any(len(v) > 1 for v in r.get("round_choices", {}).values())]
        if rc:
            names = ["auto"] + names
            lines.append("\n## Each round's choice (each round runs its own trial)\n")
            agree = []
            for m in names:
                runs = [r["round_choices"][m] for r in rc if len(r["round_choices"].get(m, [])) > 1]
                same = sum(all(c == v[0] for c in v) for v in runs)
                agree.append(f"{m}: {same} of {len(runs)}")
            lines.append("Settings whose rounds all chose alike: " + "; ".join(agree) + ".\n")
            lines.append("| setting | " + " | ".join(names) + " |")
            lines.append("|" + "---|" * (len(names) + 1))
            for r in rc:
                lines.append("| " + " | ".join([r["key"]] + [
                    " / ".join(_choices_text(c) for c in r["round_choices"].get(m, [])) or "-"
                    for m in names]) + " |")
    return "\n".join(lines) + "\n"


def heatmaps(folder: str, also: Sequence[str] = ()) -> List[str]:
    """Per model: auto / plain DDP, auto / best method and auto / the bound of a once-per-step
    exchange (see analyse) over link rate x RTT, one column per world size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    res = load(folder, also)
    paths = []
    for model in MODELS:
        mine = [r for r in res if r["model"] == model]
        if not mine:
            continue
        fig, axes = plt.subplots(3, len(WORLDS), figsize=(4.2 * len(WORLDS), 9.4), squeeze=False)
        for j, world in enumerate(WORLDS):
            for i, (field, title, cmap, lim) in enumerate(
                    (("vs_ddp", "auto / plain DDP", "RdYlGn", (0.5, 2.0)),
                     ("vs_best", "auto / best method", "RdYlGn", (0.5, 1.0)),
                     ("vs_bound", "auto / bound (floor + RTT/2)", "RdYlGn", (0.5, 1.0)))):
                ax = axes[i, j]
                grid = np.full((len(RATES), len(RTTS_MS)), np.nan)
                for r in mine:
                    if r["world"] == world and r[field] is not None:
                        grid[RATES.index(r["rate"]), RTTS_MS.index(r["rtt_ms"])] = r[field]
                norm = matplotlib.colors.LogNorm(vmin=lim[0], vmax=lim[1]) if field == "vs_ddp" \
                    else matplotlib.colors.Normalize(vmin=lim[0], vmax=lim[1])
                im = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
                for a_, b_ in itertools.product(range(len(RATES)), range(len(RTTS_MS))):
                    v = grid[a_, b_]
                    ax.text(b_, a_, "not run" if math.isnan(v) else f"{v:.2f}", ha="center",
                            va="center", fontsize=9)
                ax.set_xticks(range(len(RTTS_MS)), [f"{t:g} ms" for t in RTTS_MS])
                ax.set_yticks(range(len(RATES)), RATES)
                ax.set_xlabel("added round-trip time")
                ax.set_title(f"{title}, {world} ranks", fontsize=10)
                cb = fig.colorbar(im, ax=ax, fraction=0.046)
                ticks = [0.5, 0.75, 1.0, 1.5, 2.0] if field == "vs_ddp" else [0.5, 0.75, 0.9, 1.0]
                cb.minorticks_off()
                cb.set_ticks(ticks)
                cb.set_ticklabels([f"{t:g}x" for t in ticks])
        fig.suptitle(f"{model}: steps/s of hook('auto') (defaults)", fontsize=11)
        fig.tight_layout()
        path = os.path.join(folder, f"heatmap_{model}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "auto_sweep"))
    ap.add_argument("--report", default="", metavar="DIR",
                    help="write DIR/README.md's table (table.md) and heatmaps from DIR; run nothing")
    ap.add_argument("--also", action="append", default=[], metavar="DIR",
                    help="with --report: settings DIR has that the report's folder has not "
                         "(a sweep run in parts); repeatable")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"what each setting runs beside the compute floor: of {', '.join(METHODS)} "
                         f"and the A/B variants {', '.join(AB_METHODS)}; plain DDP and auto "
                         f"always (the ratios are against DDP, the figures about auto)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--rates", default=",".join(RATES))
    ap.add_argument("--rtts", default=",".join(f"{r:g}" for r in RTTS_MS), help="ms")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method and round")
    ap.add_argument("--warmup", type=int, default=3,
                    help="warm-up steps (auto: its whole trial and one step more)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--budget-min", type=float, default=60.0,
                    help="no new setting starts after this many minutes")
    ap.add_argument("--setting-timeout", type=float, default=1200.0, help="seconds per setting")
    a = ap.parse_args(argv)
    if a.report:
        table = report(a.report, a.also)
        with open(os.path.join(a.report, "table.md"), "w") as f:
            f.write(table)
        print(table)
        for p in heatmaps(a.report, a.also):
            print("wrote", p)
        return 0
    a.models = [m for m in a.models.split(",") if m]
    a.worlds = [int(w) for w in a.worlds.split(",") if w]
    a.rates = [r for r in a.rates.split(",") if r]
    a.rtts = [float(r) for r in a.rtts.split(",") if r]
    a.methods = [m for m in a.methods.split(",") if m]
    for m in a.methods:
        if m not in METHODS + AB_METHODS:
            raise SystemExit(f"--methods: unknown {m!r}; known: {', '.join(METHODS + AB_METHODS)}")
    for m in ("ddp", "auto"):
        if m not in a.methods:
            a.methods.insert(0, m)
    for m in a.models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown {m!r}; known: {', '.join(MODELS)}")
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
