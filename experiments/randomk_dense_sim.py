# SPDX-License-Identifier: Apache-2.0
"""One-process simulation of shared-index random-k with error feedback and DGC momentum
correction on the Fashion-MNIST CNN: which tensors make 1% diverge.

The random-k plan's step is linear in the gradient (every rank accumulates, the same indices are
taken, the values are averaged), so one process fed the mean gradient of 4 x 32 samples follows
the 4-rank run in expectation; it is 4x cheaper, so variants can be compared quickly. Not the
product: gradcomp's hook is what fashion_mnist.py measures.

    python -m experiments.randomk_dense_sim '{"variant": "rk", "dense_small": 10000}'

variant: "plain" (SGD with momentum), "rk" (momentum correction in the compressor, plain SGD),
"rko" (error-feedback random-k under the optimizer's momentum); ratio; seed; dense_small
(tensors of fewer elements sent every step); mode "geom" (k random elements a step) or "cyc"
(a random permutation walked k at a time: each element once per 1/ratio steps); mask "all"
(DGC's masking everywhere), "sparse" (not where sent every step) or "none". Prints one JSON line.
"""
import json
import math
import sys
import time

import numpy as np
import torch

from experiments.fashion_mnist import _evaluate, load_split, make_model


def run(variant, mask="all", ratio=0.01, seed=0, lr=0.05, m=0.9, steps=468, batch=128,
        dense_small=0, mode="geom"):
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    xtr, ytr = (torch.from_numpy(a) for a in load_split("train"))
    xte, yte = (torch.from_numpy(a) for a in load_split("test"))
    model = make_model("cnn")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    whole = torch.zeros(n, dtype=torch.bool)  # elements sent every step
    off = 0
    for p in params:
        if p.numel() < dense_small:
            whole[off:off + p.numel()] = True
        off += p.numel()
    whole_idx = whole.nonzero().squeeze(1)
    sampled = (~whole).nonzero().squeeze(1)
    k = max(1, int(math.ceil(ratio * sampled.numel())))
    u, v, mom = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    gen = torch.Generator().manual_seed(1234 + seed)
    order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(seed))
    cycle, pos = None, 0
    losses = []
    for t in range(steps):
        b = order[(t * batch) % len(xtr):(t * batch) % len(xtr) + batch]
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b])
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        if variant == "plain":
            mom.mul_(m).add_(g)
            upd = mom
        else:
            if variant == "rko":
                v.add_(g)
            else:
                u.mul_(m).add_(g)
                v.add_(u)
            if mode == "geom":
                sel = sampled[torch.randperm(sampled.numel(), generator=gen)[:k]]
            else:  # a random permutation walked k at a time
                if cycle is None or pos + k > sampled.numel():
                    cycle, pos = sampled[torch.randperm(sampled.numel(), generator=gen)], 0
                sel, pos = cycle[pos:pos + k], pos + k
            idx = torch.cat([sel, whole_idx])
            upd = torch.zeros(n)
            upd[idx] = v[idx]
            v[idx] = 0
            if mask == "all":
                u[idx] = 0
            elif mask == "sparse":
                u[sel] = 0
            if variant == "rko":
                mom.mul_(m).add_(upd)
                upd = mom
        with torch.no_grad():
            off = 0
            for p in params:
                p.add_(upd[off:off + p.numel()].view_as(p), alpha=-lr)
                off += p.numel()
        if not math.isfinite(loss.item()):
            losses.append(float("nan"))
            break
        if t % 25 == 0:
            losses.append(round(loss.item(), 3))
    return _evaluate(model, xte, yte), losses


if __name__ == "__main__":
    kw = json.loads(sys.argv[1])
    t0 = time.time()
    acc, losses = run(**kw)
    print(json.dumps(dict(kw=kw, acc=acc, sec=round(time.time() - t0, 1), losses=losses[::2])),
          flush=True)
