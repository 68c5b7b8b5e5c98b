# SPDX-License-Identifier: Apache-2.0
"""Small models the DDP-level experiments and their tests share."""
import torch


def relu_mlp(width: int, layers: int) -> torch.nn.Sequential:
    """`layers` square Linear(width, width) layers with ReLU between them (width^2 + width
    parameters each): a model whose gradient size is set by two numbers, for bucket and
    bandwidth experiments."""
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)
