# SPDX-License-Identifier: Apache-2.0
"""Training one configuration of the Fashion-MNIST experiment: the model, the configurations
(hook and options by name), one rank's training loop, and the launcher that runs a configuration
on N gloo ranks (loopback, or network namespaces with shaped links)."""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .data import load_split
from .launch import exit_rank, free_port, start_ranks

def make_model(kind: str = "cnn"):
    """'cnn': two 3x3 conv layers (32, 64 channels, each followed by 2x2 max pooling), then
    3136 -> 256 -> 10 (824k parameters). 'wide': the same with a 3136 -> 2048 -> 10 head (6.5M),
    a communication-bound variant. 'wide4096': a 3136 -> 4096 -> 10 head (12.9M), whose
    classifier (40,960 weights) is above random-k's default dense_below (32768), as an ImageNet
    classifier is. 'vit': a small vision transformer (vit(); 1.2M parameters), the workload of
    the AdamW runs."""
    import torch.nn as nn

    if kind == "vit":
        return vit()

    hidden = {"cnn": 256, "wide": 2048, "wide4096": 4096}[kind]
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def vit(width: int = 128, depth: int = 6, heads: int = 4, patch: int = 7):
    """A small vision transformer for 28 x 28 images: 7 x 7 patches (16 tokens of 49 pixels)
    embedded to `width`, a class token and learned positions, `depth` pre-norm blocks (LayerNorm,
    multi-head self-attention, residual; LayerNorm, a 4x MLP with GELU, residual), a final
    LayerNorm and a linear head on the class token. The defaults give 1.2M parameters, most of
    them in the attention and MLP matrices, as in a ViT-B, at 1/70 of its width."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, t):
            h = self.ln1(t)
            t = t + self.attn(h, h, h, need_weights=False)[0]
            return t + self.mlp(self.ln2(t))

    tokens = (28 // patch) ** 2

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(patch * patch, width)
            self.cls = nn.Parameter(torch.zeros(1, 1, width))
            self.pos = nn.Parameter(0.02 * torch.randn(1, 1 + tokens, width))
            self.blocks = nn.ModuleList([Block() for _ in range(depth)])
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            b = x.shape[0]
            p = x.unfold(2, patch, patch).unfold(3, patch, patch).reshape(b, tokens, -1)
            t = torch.cat([self.cls.expand(b, -1, -1), self.embed(p)], 1) + self.pos
            for blk in self.blocks:
                t = blk(t)
            return self.head(self.norm(t[:, 0]))

    return ViT()


def make_optimizer(params, args: Dict[str, Any], hook_momentum: bool, total_steps: int,
                   freeze_step: Optional[int] = None):
    """The optimizer and its per-step learning-rate factor. 'sgd' (the default): SGD with
    args['momentum'] (none when the hook applies it), constant rate. 'adamw': AdamW (betas 0.9,
    0.999; decoupled weight decay args['weight_decay']) with a linear warm-up over
    args['warmup_steps'] steps and a cosine decay to 0 at total_steps, as transformers are
    trained; a hook's momentum (DGC's momentum correction, an SGD scheme) is refused with it.
    freeze_step (with 'adamw'): gradcomp.torch.OneBitAdam instead of AdamW, same schedule."""
    import math

    import torch

    lr = float(args["lr"])
    wd = float(args.get("weight_decay", 0.0))
    if args.get("optimizer", "sgd") == "adamw":
        if hook_momentum:
            raise ValueError(f"{args['config']!r}: the hook's momentum is SGD's momentum "
                             "correction; with AdamW (its own moments) use a configuration "
                             "without it (e.g. topk-ef, onebit, randomk)")
        if freeze_step is not None:
            from gradcomp.torch import OneBitAdam

            opt = OneBitAdam(params, lr=lr, betas=(0.9, 0.999), weight_decay=wd,
                             freeze_step=freeze_step)
        else:
            opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=wd)
        warm = max(0, int(args.get("warmup_steps", 0)))

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            span = max(1, total_steps - warm)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / span)))
        return opt, factor
    if freeze_step is not None:
        raise ValueError(f"{args['config']!r}: 1-bit Adam needs --optimizer adamw")
    mom = float(args["momentum"])
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0 if hook_momentum else mom, weight_decay=wd)
    return opt, (lambda step: 1.0)


# ---- configurations --------------------------------------------------------------------------
#: DGC's sparsity warm-up (density 25%, 6.25%, 1.56%, 0.4%, then the target), one stage per
#: DGC_WARMUP_STEPS steps: the paper warms up over its first 4 of 90 epochs (4.4% of training);
#: here 4 stages of 10 steps, 8.5% of one epoch
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
DGC_WARMUP_STEPS = 10

# name -> (gradcomp hook, PyTorch baseline (experiments.baselines) or None for plain
# DDP; hook options; whether the hook applies the momentum, i.e. dgc_optimizer: plain SGD)
CONFIGS: Dict[str, Tuple[Optional[str], Dict[str, Any], bool]] = {
    "plain": (None, {}, False),
    "torch-fp16": ("torch-fp16", {}, False),
    "torch-powersgd": ("torch-powersgd", dict(rank=4), False),
    "fp16": ("fp16", {}, False),
    "bf16": ("bf16", {}, False),
    "topk": ("topk", dict(ratio=0.001, momentum=0.9), True),
    "topk-ef": ("topk", dict(ratio=0.001), False),  # error feedback only (for AdamW)
    "topk-dgc": ("topk", dict(ratio=0.001, momentum=0.9, warmup_ratios=DGC_WARMUP,
                              warmup_steps=DGC_WARMUP_STEPS), True),
    "randomk": ("randomk", dict(ratio=0.01), False),
    "randomk-mc": ("randomk", dict(ratio=0.01, momentum=0.9), True),
    "randomk10": ("randomk", dict(ratio=0.1), False),
    "randomk10-mc": ("randomk", dict(ratio=0.1, momentum=0.9), True),
    "onebit": ("onebit", {}, False),
    "onebit-mc": ("onebit", dict(momentum=0.9), True),
    "quant8": ("quant", dict(bits=8), False),
    "quant4": ("quant", dict(bits=4), False),
    "quant2": ("quant", dict(bits=2), False),
    "powersgd": ("powersgd", dict(rank=4), False),
    # sharded (FSDP2: fully_shard on every conv / linear layer and the root; torch 2.x) with
    # FSDP's own collectives, or gradcomp.torch.compress_fsdp(model, **options)
    # Local AdamW / Local SGD (no DDP: each rank steps its own replica), parameters averaged by
    # gradcomp.torch.QSRAverager: the Quadratic Synchronization Rule (period
    # max(h_base, (alpha / lr)^2), h_base during the warm-up), or alpha = 0 for a constant period
    # 1-bit Adam: gradcomp.torch.OneBitAdam (AdamW, then the variance frozen) with
    # hook("onebit", adam=opt); the freeze after this fraction of the steps (--optimizer adamw;
    # on the ViT 30% ended 0.40 points below AdamW, 15% 0.90)
    "onebit-adam": ("onebit", dict(adam=0.3), False),
    "local-qsr": ("qsr", dict(alpha=0.002, h_base=4), False),
    "local-h4": ("qsr", dict(alpha=0.0, h_base=4), False),
    # DiLoCo: the same local replicas, with an outer step (QSRAverager(outer="nesterov"): SGD
    # with Nesterov momentum 0.9, lr 0.7) on the averaged pseudo-gradient every h_base steps;
    # "compressor" (with its options) compresses the pseudo-gradient with error feedback, and
    # fragments / delay stream it (Streaming DiLoCo). Other settings as 'qsr:outer=nesterov;...'
    "diloco-h16": ("qsr", dict(alpha=0.0, h_base=16, outer="nesterov"), False),
    "diloco-h16-quant4": ("qsr", dict(alpha=0.0, h_base=16, outer="nesterov",
                                      compressor="quant", bits=4), False),
    "diloco-h16-stream": ("qsr", dict(alpha=0.0, h_base=16, outer="nesterov", fragments=4,
                                      delay=2, compressor="quant", bits=4), False),
    "diloco-qsr": ("qsr", dict(alpha=0.002, h_base=16, outer="nesterov"), False),
    "fsdp": ("fsdp", {}, False),
    "fsdp-bf16": ("fsdp", dict(grads="bf16", params="bf16"), False),
    "fsdp-quant4": ("fsdp", dict(grads="quant", bits=4), False),
    "fsdp-quant4-int8": ("fsdp", dict(grads="quant", bits=4, params="int8"), False),
}
#: the QSRAverager arguments a 'qsr' configuration may set besides alpha and h_base (others are
#: the named compressor's options)
_AVERAGER_KEYS = ("outer", "outer_lr", "outer_momentum", "fragments", "delay", "mixing",
                  "compressor")
#: suffixes a configuration may carry: "+slow" injects log-normal delays on the last rank and
#: trains with micro-batches; "+dropcompute" adds DropCompute (automatic tau) to that loop;
#: "+hier" runs the hook's two-level plan (hierarchy="node", nodes of --per-node ranks)
FLAGS = ("slow", "dropcompute", "hier")


def parse_config(spec: str) -> Tuple[str, Optional[str], Dict[str, Any], bool]:
    """'name' from CONFIGS, or 'hook:key=value;...' (values parsed as JSON, else strings), e.g.
    'onebit:block_size=0;rotate=false', optionally followed by '+slow' and '+dropcompute' (see FLAGS, read by
    config_flags). A hook option 'momentum' makes the hook apply momentum (plain SGD then)."""
    spec = spec.split("+", 1)[0]
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


def config_flags(spec: str) -> Tuple[str, ...]:
    flags = tuple(spec.split("+")[1:])
    bad = [f for f in flags if f not in FLAGS]
    if bad:
        raise ValueError(f"{spec!r}: unknown suffix {bad}; known: {', '.join(FLAGS)}")
    if "hier" in flags and spec.split("+", 1)[0] in ("plain", "torch-fp16", "torch-powersgd"):
        raise ValueError(f"{spec!r}: +hier is a gradcomp hook's option (plain DDP and PyTorch's "
                         "hooks have no two-level form)")
    if "dropcompute" in flags and "slow" not in flags:
        raise ValueError(f"{spec!r}: +dropcompute is measured against the same run with +slow; "
                         "write '+slow+dropcompute'")
    return flags


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


def _slow_delays(seed: int, step: int, m: int, a: Dict[str, Any]) -> np.ndarray:
    """The slow rank's added delay (seconds) for each of the m micro-batches of `step`: a base
    latency plus a bounded log-normal noise (DropCompute's delay environment), drawn from a
    stream keyed by (seed, step): the run with DropCompute and the one without draw the same."""
    r = np.random.default_rng([seed, 7919, step])
    noise = np.minimum(np.exp(r.normal(a["slow_log_mu"], a["slow_log_sigma"], m)), a["slow_cap_ms"])
    return (a["slow_base_ms"] + noise) / 1e3


def train_rank(rank: int, world: int, args: Dict[str, Any], out_path: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    _, hook_name, opts, hook_momentum = parse_config(args["config"])
    flags = config_flags(args["config"])
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
    fsdp = hook_name == "fsdp"
    local = hook_name == "qsr"
    comp = None
    _fsdp_wire.steps = 0  # the steps counted so far (this process may train more than once)
    if fsdp:
        model = _shard(net)
        if opts:
            import gradcomp.torch as gt

            comp = gt.compress_fsdp(model, **opts)
    elif local:
        model = net  # each rank steps its own replica; the averager syncs them
    else:
        # DDP's default bucket (25 MB) holds a small model whole: one bucket, handed over at
        # the end of backward, leaves nothing to overlap; --bucket-cap-mb splits it
        cap = args.get("bucket_cap_mb")
        model = DDP(net) if cap is None else DDP(net, bucket_cap_mb=float(cap))
    diag = _Diag(net, names) if args.get("diag") else None
    batch = int(args["batch"])
    per_step = batch * world
    steps_per_epoch = len(xtr) // per_step
    max_steps = int(args.get("steps") or 0)
    total_steps = max_steps or steps_per_epoch * int(args.get("epochs", 1))
    freeze = None  # 1-bit Adam's freeze step
    state = None
    from . import baselines

    if fsdp or local:
        pass
    elif hook_name in baselines.KINDS:
        baselines.register(hook_name, model, opts)
    elif hook_name is not None:
        import gradcomp.torch as gt

        if "hier" in flags:
            opts.update(hierarchy="node", per_node=int(args.get("per_node", 2)))
        if "adam" in opts:
            freeze = max(1, int(float(opts.pop("adam")) * total_steps))
            opt, lr_factor = make_optimizer(model.parameters(), args, False, total_steps, freeze)
            opts["adam"] = opt
        state, hook = gt.hook(hook_name, model=model, **opts)
        model.register_comm_hook(state, hook)
    lr = float(args["lr"])
    if freeze is None:
        opt, lr_factor = make_optimizer(model.parameters(), args, hook_momentum, total_steps)
    avg, outer = None, False
    qsr_next = [0]  # the step whose learning rate the averager reads
    if local:
        from gradcomp.torch import QSRAverager

        avg_kw = {k: opts[k] for k in _AVERAGER_KEYS if k in opts}
        rest = {k: v for k, v in opts.items() if k not in _AVERAGER_KEYS + ("alpha", "h_base")}
        if rest:  # the named compressor's options
            if "compressor" not in avg_kw:
                raise ValueError(f"{args['config']!r}: unknown QSRAverager options {sorted(rest)}")
            avg_kw["compressor_options"] = rest
        avg = QSRAverager(net, lambda: lr * lr_factor(qsr_next[0]), alpha=float(opts["alpha"]),
                          h_base=int(opts["h_base"]), total_steps=total_steps,
                          warmup_steps=int(args.get("warmup_steps", 0)), **avg_kw)
        outer = avg.outer_optimizer is not None
    log_every = int(args.get("log_every", 25))
    eval_every = int(args.get("eval_every") or 0)

    # micro-batches: with a slow rank (its delays after each micro-batch) and DropCompute
    M = int(args.get("micro_batches", 4)) if "slow" in flags else 1
    if batch % M:
        raise ValueError(f"batch {batch} is not a multiple of micro_batches {M}")
    slow = "slow" in flags and rank == world - 1
    dc = None
    if "dropcompute" in flags:
        from gradcomp.torch.dropcompute import DropCompute

        dc = DropCompute(model, M, tau=None, warmup_steps=int(args.get("dc_warmup", 5)))
    # bytes a ring allreduce moves per step without a gradcomp hook (analytic)
    plain_bytes = (0 if fsdp else
                   baselines.bytes_per_step("ddp" if local else hook_name or "ddp", net, opts)
                   if state is None else 0)
    local_wire = 0.0  # Local SGD / AdamW: the averagings' wire bytes so far
    fsdp_seen = [0, 0]  # compress_fsdp's total wire bytes, dense wire bytes at the last step
    # bytes on one rank's link per step when a ring allreduce moves `b` bytes
    ring_wire = lambda b: 2 * (world - 1) * b / world  # noqa: E731

    losses: List[float] = []
    log: List[Dict[str, Any]] = []
    steps_log: List[Tuple[int, float, float, float]] = []  # (step, train seconds, loss, wire bytes)
    acc_log: List[Tuple[int, float, float]] = []  # (step, train seconds, accuracy), rank 0
    accs = []
    train_s = 0.0  # time in training steps; evaluation excluded
    step = 0
    epochs = int(args.get("epochs", 1))
    wire_seen = 0  # the hook's total wire bytes at the last step
    sample_frac: List[float] = []
    done = False
    for epoch in range(epochs):
        perm = torch.from_numpy(np.random.default_rng(seed * 1000 + epoch).permutation(len(xtr)))
        for s in range(steps_per_epoch):
            if max_steps and step >= max_steps:
                done = True
                break
            idx = perm[s * per_step + rank * batch: s * per_step + (rank + 1) * batch]
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(step)
            opt.zero_grad()
            if M == 1:
                loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                step_loss = float(loss)
            else:
                parts = idx.view(M, batch // M)
                delays = _slow_delays(seed, step, M, args) if slow else None
                mb_losses = []

                def micro(m, scale):
                    lm = torch.nn.functional.cross_entropy(model(xtr[parts[m]]), ytr[parts[m]])
                    (lm * scale).backward()
                    mb_losses.append(float(lm))
                    if delays is not None:
                        time.sleep(float(delays[m]))
                if dc is None:
                    for m in range(M):
                        if m < M - 1:
                            with model.no_sync():
                                micro(m, 1.0 / M)
                        else:
                            micro(m, 1.0 / M)
                else:
                    for m, _ in enumerate(dc.microbatches(iter(range(M)))):
                        micro(m, 1.0)
                sample_frac.append(len(mb_losses) / M)
                step_loss = sum(mb_losses) / len(mb_losses)
            rec = None
            if diag is not None and step % log_every == 0:
                rec = {"step": step, "layers": diag.record()}
            opt.step()
            synced = False
            if avg is not None:
                qsr_next[0] = step + 1
                synced = avg.step()
            train_s += time.perf_counter() - t0
            losses.append(step_loss)
            if fsdp:
                w, d = _fsdp_wire(model, world, comp)
                wire, fsdp_seen[0] = w - fsdp_seen[0], w
                fsdp_dense, fsdp_seen[1] = d - fsdp_seen[1], d
            elif state is not None:
                total = state.totals["wire_bytes"]
                wire, wire_seen = total - wire_seen, total
            elif local and outer:  # what the outer steps put on this rank's link
                wire = avg.wire_bytes - local_wire
                local_wire = avg.wire_bytes
            elif local:  # an averaging is one ring allreduce of the parameters
                wire = ring_wire(plain_bytes) if synced else 0.0
                local_wire += wire
            else:
                wire = ring_wire(plain_bytes)
            steps_log.append((step, train_s, step_loss, wire))
            if rec is not None or step % log_every == 0:
                rec = rec or {"step": step}
                rec["loss"] = sum(losses[-log_every:]) / len(losses[-log_every:])
                if diag is not None and state is not None:
                    rec["error"] = _error_norms(state, names)
                log.append(rec)
            step += 1
            if eval_every and step % eval_every == 0 and (rank == 0 or fsdp):
                a = _evaluate(model, xte, yte)  # a sharded model evaluates on every rank
                if rank == 0:
                    acc_log.append((step, train_s, a))
        if done:
            break
        accs.append(_evaluate(model, xte, yte))
        if rank == 0:
            if not acc_log or acc_log[-1][0] != step:
                acc_log.append((step, train_s, accs[-1]))
            print(f"  {args['config']} seed {seed}: epoch {epoch + 1}/{epochs}, step {step}, "
                  f"test accuracy {100 * accs[-1]:.2f}%, {train_s:.1f} s training", flush=True)
    if done or not accs:
        accs.append(_evaluate(model, xte, yte))
        if rank == 0 and (not acc_log or acc_log[-1][0] != step):
            acc_log.append((step, train_s, accs[-1]))
    # every rank's fraction of the nominal samples it computed (DropCompute drops some)
    import torch.distributed as dist

    fr = torch.zeros(world, dtype=torch.float64)
    fr[rank] = (sum(sample_frac) / len(sample_frac)) if sample_frac else 1.0
    dist.all_reduce(fr)
    if fsdp:  # per step: this rank's link, and what FSDP's own collectives move for the same
        fsdp_wire = steps_log[-1][3] if steps_log else 0
        plain_bytes = fsdp_dense if steps_log else 0
    hist = state.history if state is not None else []
    sent = [h["bytes_sent"] for h in hist[-10:]] if hist else []
    wire = [h["wire_bytes"] for h in hist[-10:]] if hist else []
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        res = {"config": args["config"], "seed": seed, "world": world, "lr": lr, "steps": step,
               "model": args.get("model", "cnn"), "params": dense // 4,
               "optimizer": args.get("optimizer", "sgd"),
               "weight_decay": float(args.get("weight_decay", 0.0)),
               "warmup_steps": int(args.get("warmup_steps", 0)),
               "bucket_cap_mb": args.get("bucket_cap_mb"),  # None: DDP's default
               "buckets": len(getattr(state, "buckets", None) or {}) if state is not None else None,
               "steps_per_epoch": steps_per_epoch,
               "accuracy": accs[-1], "accuracy_per_epoch": accs,
               # (step, seconds of training so far, test accuracy)
               "accuracy_log": acc_log,
               "wall_s": train_s,
               "final_loss": sum(losses[-25:]) / max(1, len(losses[-25:])),
               "dense_bytes": dense,
               "bytes_sent_per_step": (fsdp_wire if fsdp else
                                       None if local and outer else
                                       plain_bytes * len(avg.sync_steps) / max(1, step)
                                       if local else
                                       (sum(sent) / len(sent)) if state is not None and sent
                                       else None if state is not None else plain_bytes),
               # on this rank's link (ring allreduce / direct all-to-all / ring allgather):
               # plain DDP's allreduce moves 2 (P-1)/P of the dense bytes
               "wire_bytes_per_step": (fsdp_wire if fsdp else local_wire / max(1, step)
                                       if local else
                                       (sum(wire) / len(wire)) if state is not None and wire
                                       else None if state is not None else ring_wire(plain_bytes)),
               "plain_wire_bytes_per_step": plain_bytes if fsdp else ring_wire(dense),
               "fsdp_totals": comp.totals() if comp is not None else None,
               "micro_batches": M,
               "samples_fraction": float(fr.mean()), "samples_fraction_per_rank": fr.tolist(),
               "dropcompute_tau": (dc.tau if dc is not None else None),
               "sync_steps": avg.sync_steps if avg is not None else None,
               # rank 0's seconds in the averager's step(): what synchronizing cost its wall time
               "sync_s": avg.sync_seconds if avg is not None else None,
               "freeze_step": freeze,
               "steps_log": steps_log,
               "log": log}
        with open(out_path, "w") as f:
            json.dump(res, f)


def _shard(net):
    """FSDP2: every conv / linear layer a unit of its own, then the root."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    for m in net:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            fully_shard(m)
    fully_shard(net)
    return net


def _fsdp_wire(model, world: int, comp) -> Tuple[int, int]:
    """Cumulative bytes on this rank's link of a sharded model's collectives, and what FSDP's own
    ring reduce-scatter and allgather move for the same calls. compress_fsdp counts the kinds it
    runs; a kind left to FSDP is counted here from the shapes: per step, one reduce-scatter and
    two allgathers (forward, and backward after resharding) of each layer's padded parameters,
    (P - 1) / P of them on the link."""
    import torch.nn as nn

    _fsdp_wire.steps += 1
    per = 0
    for m in model:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            for p in m.parameters():
                rows = p.shape[0]
                padded = -(-rows // world) * world * (p.numel() // max(1, rows))
                per += (world - 1) * padded * p.element_size() // world
    t = comp.totals() if comp is not None else None
    n = _fsdp_wire.steps
    rs = t["reduce_scatter"] if t and comp.grads else {"wire_bytes": per * n,
                                                       "dense_wire_bytes": per * n}
    ag = t["allgather"] if t and comp.params else {"wire_bytes": 2 * per * n,
                                                   "dense_wire_bytes": 2 * per * n}
    return (rs["wire_bytes"] + ag["wire_bytes"], rs["dense_wire_bytes"] + ag["dense_wire_bytes"])


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
def rank_entry(rank, world, init, args, out_path):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if isinstance(init, int):
        init = f"tcp://127.0.0.1:{init}"
    from . import latency

    # --delay: gloo with that one-way latency per message round (experiments.latency)
    backend = latency.backend_for(args.get("delay", ""), per_node=int(args.get("per_node", 1)))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(args.get("timeout", 1800))))
    try:
        train_rank(rank, world, args, out_path)
    finally:
        dist.destroy_process_group()
    exit_rank()  # the results are written


def run_config(args: Dict[str, Any], world: int = 4, netns: str = "",
               delay: str = "") -> Dict[str, Any]:
    """Trains one configuration on `world` gloo ranks in fresh processes; returns rank 0's
    result (accuracy, loss log, training time, bytes per step). With `netns` (root) every rank
    runs in its own network namespace with links of that rate (experiments.netem);
    else all ranks talk over loopback. With `delay` ("5ms": one-way), every collective pays
    that latency per message round (experiments.latency; torch 2.x)."""
    config_flags(args["config"])  # reject a bad suffix before starting anything
    parse_config(args["config"])
    if delay:
        from . import latency

        latency.parse_delay(delay)  # a bad value fails here, not in every rank
        args = dict(args, delay=delay)
    fd, out_path = tempfile.mkstemp(prefix="gradcomp-fmnist-", suffix=".json")
    os.close(fd)
    try:
        if netns:
            from . import netem

            blob = json.dumps(args)
            netem.run_in_namespaces(
                world, netns,
                lambda r: [sys.executable, "-m", "experiments.fashion_mnist",
                           "--_rank", str(r), "--world", str(world),
                           "--_init", f"tcp://{netem.RANK0_ADDR}:29517", "--_args", blob,
                           "--_result", out_path],
                timeout=float(args.get("timeout", 1800)))
        else:
            start_ranks(rank_entry, (world, free_port(), args, out_path), world)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)
