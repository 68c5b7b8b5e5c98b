# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the FSDP2 tests (test_fsdp.py, test_fsdp_hostile.py; the GPU suites'
FSDP cases): whether this torch has FSDP2 (with custom collectives), the sharded test model, and
a rank's local shards."""
import pytest
import torch

from ddp_util import Net

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    HAVE_FSDP2 = hasattr(FSDPModule, "set_custom_reduce_scatter")
except (ImportError, ValueError):  # torch 1.13's fsdp package fails to import on Python 3.11
    fully_shard = None
    HAVE_FSDP2 = False


def have_fully_shard():
    """Whether torch.distributed.fsdp has fully_shard (FSDP2), with custom collectives or not."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        return True
    except (ImportError, ValueError):
        return False


needs_fsdp2 = pytest.mark.skipif(
    not HAVE_FSDP2, reason=f"FSDP2 custom collectives need torch 2.x (this is {torch.__version__})")


def shard(model, layers, **kw):
    """fully_shard(**kw) on each of `layers`, then on the root `model`."""
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def sharded_net(seed=0, d_hidden=37, **kw):
    """ddp_util.Net with its three layers and the root sharded; 37 hidden rows by default, which
    do not split evenly (FSDP pads the shards)."""
    torch.manual_seed(seed)
    m = Net(d_hidden=d_hidden)
    return shard(m, (m.fc1, m.fc2, m.fc3), **kw)


def local_params(model):
    """This rank's shard of every parameter (copies)."""
    return [p.to_local().detach().clone() for p in model.parameters()]


def local_grads(model):
    """This rank's shard of every gradient (copies; None where a parameter has none)."""
    return [None if p.grad is None else p.grad.to_local().detach().clone()
            for p in model.parameters()]
