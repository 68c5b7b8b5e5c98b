# SPDX-License-Identifier: Apache-2.0
"""How much of a gradient block one sign and one scale keep, with and without the 1-bit plan's
randomized Hadamard rotation.

Trains the Fashion-MNIST CNN of experiments.fashion_mnist on one process (SGD lr 0.05,
momentum 0.9, batch 32) and at a few steps cuts the flattened gradient g and the momentum u
(DDP's bucket order: last layer first) into blocks of 128 elements. For each it prints the
fraction of the energy the sign with the L1 scale loses, 1 - sum_b |x_b|_1^2 / (S |x|_2^2)
(the best single scale; 1 - 2/pi = 0.36 for Gaussian blocks), and the same after rotating each
block by H D / sqrt(S) as the plan does (D: fixed random signs; here from torch's generator, the
fraction does not depend on which signs), plus the median per-block alpha = |x_b|_1^2 /
(S |x_b|_2^2).

    .venv/bin/python -m experiments.onebit_block_error [--steps 300] [--block 128]
"""
import argparse

import numpy as np
import torch

from experiments.fashion_mnist import load_split, make_model


def hadamard(S: int) -> torch.Tensor:
    H = torch.ones(1, 1)
    while H.shape[0] < S:  # Sylvester's construction
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / S ** 0.5


def blocks(v: torch.Tensor, S: int) -> torch.Tensor:
    n = v.numel() // S * S  # full blocks only, as the plan rotates them
    return v[:n].view(-1, S).double()


def lost(v: torch.Tensor, S: int):
    b = blocks(v, S)
    l1, l2 = b.abs().sum(1), b.pow(2).sum(1)
    ok = l2 > 0
    return float(1 - (l1 ** 2 / S).sum() / l2.sum()), float((l1[ok] ** 2 / (S * l2[ok])).median())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    x, y = load_split("train")
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    net = make_model("cnn")
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    S = a.block
    D = (torch.randint(0, 2, (S,), generator=torch.Generator().manual_seed(1)) * 2 - 1).double()
    R = D[:, None] * hadamard(S).double()  # row-vector block b -> b @ R = H D b / sqrt(S)
    print(f"block {S}: energy lost by sign + L1 scale (median block alpha)")
    print("| step | gradient | gradient, rotated | momentum | momentum, rotated |")
    print("|---|---|---|---|---|")
    marks = sorted({5, 50, 150, a.steps})
    for step in range(a.steps + 1):
        idx = torch.randint(0, len(x), (32,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        if step in marks:
            g = torch.cat([p.grad.reshape(-1) for p in reversed(params)])
            u = (torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in reversed(params)])
                 if step else g)
            cells = []
            for v in (g, u):
                for rot in (False, True):
                    w = (blocks(v, S) @ R).reshape(-1) if rot else v
                    f, med = lost(w, S)
                    cells.append(f"{f:.3f} ({med:.3f})")
            print(f"| {step} | " + " | ".join(cells) + " |")
        opt.step()


if __name__ == "__main__":
    main()
