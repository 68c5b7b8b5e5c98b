# SPDX-License-Identifier: Apache-2.0
"""Our PowerSGD hook against PyTorch's powerSGD_hook on the same model, seed, data and rank.

The two differ by construction in one place: the initial Q. PyTorch draws it from torch.randn
with a seeded generator; ours comes from the counter-based RNG (uniform in [-1, 1), identical on
CPU and CUDA). The subspace that warm-started power iteration tracks is the same, so the trained
parameters agree closely but not bitwise. Everything else (start iteration with plain allreduce,
min_compression_rate, uncompressed 1-D tensors, error feedback, warm start, Gram-Schmidt) follows
the same algorithm. So the yardstick is PyTorch against itself with another seed: our distance
from PyTorch's result must be of the same size as the distance between two PyTorch runs that
differ only in the seed of the initial Q (and small compared with how far training moved the
parameters).
"""
import json
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import Net, make_data, params_equal_across_ranks, run, tmpdir, train  # noqa: E402

STEPS = 30
RANK = 2


def _torch_hook_waited(state, bucket):
    """PyTorch's powerSGD_hook, waited for inside the hook (it issues its P and Q allreduces from
    gloo's completion threads; with several buckets it hangs or aborts, bench/results/
    psgd_default_buckets_*). The model is one bucket, which DDP waits for at the end of backward
    anyway: the arithmetic is unchanged."""
    fut = ps.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _train(rank, world, out_dir, which, seed=0):
    data = make_data(rank, STEPS, batch=32)
    torch.manual_seed(0)
    model = DDP(Net(d_in=32, d_hidden=96, d_out=8))
    start = [p.detach().clone() for p in model.parameters()]
    if which == "torch":
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                 start_powerSGD_iter=2, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True, random_seed=seed)
        model.register_comm_hook(state, _torch_hook_waited)
    else:
        state, hook = gt.hook("powersgd", rank=RANK, start_iter=2, min_compression_rate=2.0)
        model.register_comm_hook(state, hook)
    train(model, torch.optim.SGD(model.parameters(), lr=0.05), data)
    assert params_equal_across_ranks(model)
    if rank == 0:
        final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        moved = final - torch.cat([p.reshape(-1) for p in start])
        torch.save({"final": final, "moved": moved}, os.path.join(out_dir, f"{which}{seed}.pt"))


def _torch_reference(d, seed, attempts=3):
    """PyTorch's hook is the yardstick, not what is tested, and on torch 2.15 + gloo a rank
    running it aborts now and then ("terminate called without an active exception": 2 of 49
    runs, against 0 of 62 runs of ours in the same setting, 2026-11-24): such a run is repeated."""
    for i in range(attempts):
        try:
            run(_train, 2, d, "torch", seed)
            return
        except mp.ProcessExitedException:  # killed by a signal (SIGABRT), not a Python error
            if i == attempts - 1:
                raise


def test_matches_pytorch_powersgd_hook_closely():
    d = tmpdir()
    _torch_reference(d, 0)
    _torch_reference(d, 1)
    run(_train, 2, d, "ours", 0)
    t0, t1, ours = (torch.load(os.path.join(d, f)) for f in ("torch0.pt", "torch1.pt", "ours0.pt"))
    moved = t0["moved"].norm().item()
    ours_vs_torch = (ours["final"] - t0["final"]).norm().item() / moved
    torch_vs_torch = (t1["final"] - t0["final"]).norm().item() / moved
    with open(os.path.join(d, "powersgd_vs_torch.json"), "w") as f:
        json.dump({"ours_vs_torch": ours_vs_torch, "torch_seed0_vs_seed1": torch_vs_torch}, f)
    print(f"relative to the distance moved: ours vs torch {ours_vs_torch:.4f}, "
          f"torch seed 0 vs seed 1 {torch_vs_torch:.4f}")
    assert moved > 0.1
    assert ours_vs_torch < 0.3
    assert ours_vs_torch < 1.5 * torch_vs_torch + 0.01
