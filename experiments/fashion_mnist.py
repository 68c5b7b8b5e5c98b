# SPDX-License-Identifier: Apache-2.0
"""Fashion-MNIST training with DDP and gradcomp hooks: accuracy of each compressor against plain
DDP at the same learning rate, on N gloo ranks (loopback).

Data: Debian's ``dataset-fashion-mnist`` package (IDX files under
``/usr/share/datasets/fashion-mnist/``, or ``$GRADCOMP_FASHION_MNIST``). Nothing is downloaded.

Run (4 ranks, one epoch, every configuration, two seeds)::

    python -m experiments.fashion_mnist --configs plain,onebit --seeds 0,1

Each configuration runs in fresh processes with the same seed, initial weights and data order;
rank r trains on shard r of each epoch's permutation (``batch`` samples per rank per step).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from .data import DEFAULT_DIR, load_idx, load_split  # noqa: F401
from .report import (COUNTERPART, git_output, markdown_table, plot, setting_of,  # noqa: F401
                     summarize, time_to_target, write_report)
from .train import (CONFIGS, DGC_WARMUP, DGC_WARMUP_STEPS, FLAGS, config_flags,  # noqa: F401
                    make_model, parse_config, rank_entry, run_config, train_rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="plain,onebit",
                    help=f"comma-separated: {', '.join(CONFIGS)} or hook:key=value;..., each "
                         "optionally with +slow or +slow+dropcompute")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2,
                    help="ranks per node of the configurations with +hier (two-level plans)")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                    help="adamw: linear warm-up over --warmup-steps, then cosine decay to 0")
    ap.add_argument("--lr", type=float, default=None, help="default 0.05 (sgd), 1e-3 (adamw)")
    ap.add_argument("--weight-decay", type=float, default=None,
                    help="default 0 (sgd), 0.05 (adamw, decoupled)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="adamw's linear warm-up; default 5%% of the run's steps")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket size (default: DDP's own, 25 MB)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    ap.add_argument("--model", default="cnn", choices=["cnn", "wide", "wide4096", "vit"])
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
    ap.add_argument("--delay", default="",
                    help="one-way latency added to every collective per message round (e.g. "
                         "5ms; experiments.latency, torch 2.x)")
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
        rank_entry(a._rank, a.world, a._init, json.loads(a._args), a._result)
        return 0
    if a.quick:
        a.world, a.steps, a.train_subset, a.test_subset = 2, 150, 10000, 2000
        a.eval_every = a.eval_every or 25
        a.target = a.target or 0.75
        if a.configs == ap.get_default("configs"):
            a.configs = ("plain,fp16,topk-ef,onebit,powersgd" if a.optimizer == "adamw" else
                         "plain,torch-fp16,fp16,topk-dgc,onebit-mc,powersgd,torch-powersgd")
        a.report = a.report or os.path.join("build", "experiments", "quick")
    adamw = a.optimizer == "adamw"
    a.lr = a.lr if a.lr is not None else (1e-3 if adamw else 0.05)
    a.weight_decay = a.weight_decay if a.weight_decay is not None else (0.05 if adamw else 0.0)
    if a.warmup_steps is None:  # 5% of the steps of one run (a.steps, or its epochs)
        per_epoch = (a.train_subset or 60000) // (a.batch * a.world)
        a.warmup_steps = int(0.05 * (a.steps or per_epoch * a.epochs)) if adamw else 0
    for cfg in [c for c in a.configs.split(",") if c and not a.from_results]:
        parse_config(cfg)
        config_flags(cfg)
    load_split("test")  # fail early with the package hint
    if a.netns and not a.from_results:  # with --from-results, --netns only labels old runs
        from . import netem

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
    # the code the runs use: read now, the tree may move while they train
    commit = ((git_output("rev-parse", "--short", "HEAD") or "unknown")
              + (" (with uncommitted changes)" if git_output("status", "--porcelain",
                                                       "--untracked-files=no") else ""))
    load_before = os.getloadavg()[0]
    for seed in [int(s) for s in a.seeds.split(",") if s]:
        for cfg in [c for c in a.configs.split(",") if c]:
            args = dict(config=cfg, seed=seed, lr=a.lr, momentum=a.momentum, batch=a.batch,
                        epochs=a.epochs, steps=a.steps, model=a.model,
                        train_subset=a.train_subset, test_subset=a.test_subset, diag=a.diag,
                        log_every=a.log_every, eval_every=a.eval_every,
                        micro_batches=a.micro_batches, slow_base_ms=a.slow_base_ms,
                        slow_log_mu=a.slow_log_mu, slow_log_sigma=a.slow_log_sigma,
                        slow_cap_ms=a.slow_cap_ms, timeout=a.timeout, per_node=a.per_node,
                        bucket_cap_mb=a.bucket_cap_mb,
                        optimizer=a.optimizer, weight_decay=a.weight_decay,
                        warmup_steps=a.warmup_steps)
            try:
                r = run_config(args, a.world, netns=a.netns, delay=a.delay)
            except Exception as e:  # a diverged run (non-finite check) or a failed rank
                # recorded, and the other configurations still run; the exit status says so
                failed.append({"config": cfg, "seed": seed, "error": _last_line(e)})
                print(f"{cfg:24s} seed {seed}: FAILED: {failed[-1]['error']}", flush=True)
                continue
            r.update(link=link, momentum=a.momentum, batch=a.batch, eval_every=a.eval_every,
                     commit=commit)
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
                    commit=commit,
                    torch=torch.__version__, command="python -m experiments.fashion_mnist "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    load_before=load_before, load_after=os.getloadavg()[0],
                    wall_s=time.time() - t_start, model=a.model, world=a.world,
                    link=link, lr=a.lr, momentum=a.momentum, batch=a.batch,
                    optimizer=a.optimizer, weight_decay=a.weight_decay,
                    warmup_steps=a.warmup_steps,
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
