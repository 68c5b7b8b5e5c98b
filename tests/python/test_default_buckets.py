# SPDX-License-Identifier: Apache-2.0
"""Our PowerSGD (and top-k) hooks complete with DDP's default buckets (bucket_cap_mb=25) on gloo.

PyTorch's own powerSGD_hook, registered as its documentation shows, fails in this setting: it
issues its P and Q allreduces from gloo's completion callbacks, in an order that differs between
ranks, and hangs (torch 2.15) or aborts with a gloo size mismatch (torch 1.13);
bench/psgd_default_buckets.py --hook torch shows it, bench/results/psgd_default_buckets_*.md
records it. This
test runs only our hooks, so CI never depends on PyTorch's hang: the ranks must finish within a
deadline, and are killed (the test failing) if they do not.
"""
import os
import time

import pytest
import torch

from ddp_util import finish, free_port, rank_context

WORLD = 4
WIDTH, LAYERS = 1024, 4  # 4.2M parameters: two of DDP's buckets (1 MiB first bucket, then 25 MB)
STEPS = 6
DEADLINE_S = 240.0


def _rank(rank, world, port, compressor, opts):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp.torch as gt
    from experiments.models import relu_mlp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = DDP(relu_mlp(WIDTH, LAYERS))  # DDP's default bucket_cap_mb (25), as the experiment
    state, hook = gt.hook(compressor, model=model, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
    assert len(state.history) == STEPS
    # more than one bucket per step after DDP's rebuild (iteration 0 runs its initial layout),
    # or this would not be the case PyTorch's hook hangs on
    assert all(h["buckets"] >= 2 for h in state.history[1:]), state.history
    finish()


@pytest.mark.parametrize("compressor, opts", [("powersgd", dict(rank=1)),
                                              ("powersgd", dict(rank=4)),
                                              ("topk", dict(ratio=0.01))])
def test_hook_completes_with_default_buckets_on_gloo(compressor, opts):
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, WORLD, port, compressor, opts))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].kill()
    for p in procs:
        p.join()
    assert not hung, (f"{compressor} {opts}: ranks {hung} still running after {DEADLINE_S:.0f} s "
                      "with DDP's default buckets")
    assert [p.exitcode for p in procs] == [0] * WORLD
