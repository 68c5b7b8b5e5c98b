# SPDX-License-Identifier: Apache-2.0
"""DiLoCo side by side: torchft's implementation and gradcomp's QSRAverager(outer="nesterov"),
on the same workload, seeds, data order and initial weights.

Workload: the Fashion-MNIST CNN of the training experiment (experiments.train.make_model),
W replicas (one process each), 32 images per replica per step, the inner optimizer SGD (lr 0.05,
momentum 0.9) or AdamW (lr 1e-3, weight decay 0.05), both at a constant rate, and the outer
optimizer SGD with Nesterov momentum 0.9, lr 0.7, every H steps. Each run records its final test
accuracy and parameters; the report compares the two implementations' final parameters (they
run the same algorithm: they differ by the order of the floating-point sums only; the first run
of --runs is the reference) and what each
put on the wire (torchft: one ring allreduce of the float32 parameters per round, counted from
its sizes; gradcomp: what the averager counted, headers included).

torchft needs its own environment (torch >= 2.7): ``pip install torchft`` (it brings a CUDA
build of torch; the comparison runs on the CPU with gloo). Its quantized outer all-reduce
(``should_quantize=True``) runs on CUDA only (triton); on a CPU it fails inside its manager and
every round is discarded, so only its float32 form is compared here.

    PYTHONPATH=python_bindings <venv with torchft>/bin/python -m experiments.torchft_compare \\
        --world 4 --out experiments/results/<dir>
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _data(rank: int, world: int, steps: int, seed: int):
    from experiments.data import load_split
    xtr, ytr = load_split("train")
    xte, yte = load_split("test")
    rng = np.random.default_rng(seed)
    epochs = -(-steps * world * 32 // len(xtr))  # a new permutation for each pass
    perm = np.concatenate([rng.permutation(len(xtr)) for _ in range(epochs)])
    batch = 32
    idx = [perm[(s * world + rank) * batch:(s * world + rank + 1) * batch] for s in range(steps)]
    return (torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(ytr),
            torch.from_numpy(np.ascontiguousarray(xte)), torch.from_numpy(yte), idx)


def _inner(model, inner: str):
    if inner == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)


def _train(model, opt, xtr, ytr, idx, after_step=None) -> float:
    t0 = time.perf_counter()
    for s, ix in enumerate(idx):
        ix = torch.from_numpy(ix)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[ix]), ytr[ix]).backward()
        opt.step()
        if after_step is not None:
            after_step()
    return time.perf_counter() - t0


def _worker(rank: int, cfg: dict, port: int, lighthouse: str, out: str) -> None:
    from experiments.train import _evaluate, make_model
    torch.set_num_threads(1)
    world, steps = cfg["world"], cfg["steps"]
    xtr, ytr, xte, yte, idx = _data(rank, world, steps, cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model = make_model("cnn")
    opt = _inner(model, cfg["inner"])
    res = {"config": cfg}
    if cfg["impl"] == "torchft":
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        t = timedelta(seconds=300)
        manager = Manager(pg=ProcessGroupGloo(), load_state_dict=model.load_state_dict,
                          state_dict=model.state_dict, min_replica_size=world,
                          use_async_quorum=False, replica_id=f"replica{rank}",
                          store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                          lighthouse_addr=lighthouse, hostname="127.0.0.1", init_sync=False,
                          timeout=t, quorum_timeout=t, connect_timeout=t)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], opt, outer, sync_every=cfg["h"]):
            res["train_s"] = _train(model, opt, xtr, ytr, idx)
        res["rounds"] = manager.current_step()
        n = sum(p.numel() for p in model.parameters())
        res["wire_bytes"] = res["rounds"] * 2 * (world - 1) * 4 * n // world
        manager.shutdown(wait=False)
    else:
        from gradcomp.torch import QSRAverager
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        kw = {}
        if cfg.get("bits"):
            kw = dict(compressor="quant", compressor_options=dict(bits=cfg["bits"]))
        avg = QSRAverager(model, opt, alpha=0.0, h_base=cfg["h"], total_steps=steps,
                          outer="nesterov", **kw)
        res["train_s"] = _train(model, opt, xtr, ytr, idx, avg.step)
        res["rounds"] = len(avg.sync_steps)
        res["wire_bytes"] = avg.wire_bytes
    res["accuracy"] = _evaluate(model, xte, yte)
    res["final_params"] = [p.detach().clone() for p in model.parameters()]
    torch.save(res, os.path.join(out, f"{cfg['name']}_r{rank}.pt"))
    if cfg["impl"] != "torchft":
        dist.barrier()
        dist.destroy_process_group()


def _run(cfg: dict, out: str) -> dict:
    lighthouse, server = "", None
    if cfg["impl"] == "torchft":
        from torchft.coordination import LighthouseServer
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=cfg["world"])
        lighthouse = server.address()
    from experiments.launch import free_port
    port = free_port()
    t0 = time.time()
    mp.start_processes(_worker, args=(cfg, port, lighthouse, out), nprocs=cfg["world"],
                       start_method="spawn")
    if server is not None:
        server.shutdown()
    ranks = [torch.load(os.path.join(out, f"{cfg['name']}_r{r}.pt")) for r in range(cfg["world"])]
    row = {k: ranks[0][k] for k in ("accuracy", "rounds", "wire_bytes", "train_s")}
    row.update(name=cfg["name"], wall_s=time.time() - t0,
               replicas_identical=all(torch.equal(a, b) for r in ranks[1:]
                                      for a, b in zip(ranks[0]["final_params"],
                                                      r["final_params"])))
    return row, ranks[0]["final_params"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", default="torchft:16,gradcomp:16,gradcomp:16:4,torchft:128",
                    help="comma-separated impl:H[:bits] (bits: gradcomp's quant outer step); "
                         "the first is the reference of the parameter comparison")
    ap.add_argument("--steps", type=int, default=512,
                    help="a multiple of every H: torchft leaves the steps after its last round "
                         "unsynced")
    ap.add_argument("--inner", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    base = dict(world=a.world, steps=a.steps, inner=a.inner, seed=a.seed)
    cfgs = []
    for spec in a.runs.split(","):
        impl, h, *bits = spec.split(":")
        if impl not in ("torchft", "gradcomp") or (bits and impl != "gradcomp"):
            raise SystemExit(f"bad run {spec!r}: torchft:H or gradcomp:H[:bits]")
        if a.steps % int(h):
            raise SystemExit(f"--steps {a.steps} is not a multiple of H = {h}")
        cfgs.append(dict(base, impl=impl, h=int(h), bits=int(bits[0]) if bits else 0,
                         name=spec.replace(":", "_")))
    load_before = os.getloadavg()[0]
    rows, params = [], {}
    for cfg in cfgs:
        row, params[cfg["name"]] = _run(cfg, a.out)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref = params[cfgs[0]["name"]]
    for row in rows:
        p = params[row["name"]]
        diff = max(float((x - y).abs().max()) for x, y in zip(p, ref))
        scale = max(float(y.abs().max()) for y in ref)
        row["max_abs_diff_vs_first"] = diff
        row["max_abs_diff_vs_first_rel"] = diff / scale
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit,
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                torch=torch.__version__, load_before=load_before,
                load_after=os.getloadavg()[0], rows=rows)
    with open(os.path.join(a.out, "torchft_compare.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for f in os.listdir(a.out):
        if f.endswith(".pt"):
            os.remove(os.path.join(a.out, f))


if __name__ == "__main__":
    main()
