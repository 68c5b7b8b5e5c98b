# SPDX-License-Identifier: Apache-2.0
"""Does a PowerSGD DDP hook complete with DDP's default buckets (bucket_cap_mb=25) on gloo?

Runs WORLD gloo ranks on 127.0.0.1, each training a DDP model of `--layers` Linear(width, width)
layers (default 4 x 1024 x 1024 = 4.2M parameters, several 25 MB buckets after DDP's rebuild)
for `--steps` steps with one hook, and reports whether every rank finished within `--timeout`
seconds. Hooks: ``torch`` (PyTorch's powerSGD_hook, registered as its documentation shows, not
waited inside the hook) and ``ours`` (gradcomp.torch's powersgd hook). The ranks are killed when
the timeout passes.

    python -m experiments.psgd_default_buckets --hook torch --timeout 120
    python -m experiments.psgd_default_buckets --hook ours

Prints one line: torch version, hook, world, parameters, outcome (completed / hung / failed) and
seconds; the exit status is 0 when the run completed, 1 when it hung or failed. PyTorch's hook
issues its P and Q allreduces from gloo's completion callbacks, whose order differs between
ranks with more than one bucket: it hangs, or gloo aborts on mismatched sizes
("op.preamble.length <= op.nbytes"). tests/python/test_default_buckets.py keeps ours completing.
"""
import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

from experiments.launch import free_port




def _rank(rank, world, port, hook, width, layers, steps, rank_r):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from experiments.models import relu_mlp

    torch.manual_seed(0)
    model = DDP(relu_mlp(width, layers))  # DDP's default bucket_cap_mb (25)
    if hook == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                 start_powerSGD_iter=2)
        model.register_comm_hook(state, ps.powerSGD_hook)
    else:
        import gradcomp.torch as gt
        state, h = gt.hook("powersgd", rank=rank_r, model=model)
        model.register_comm_hook(state, h)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, width, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hook", choices=["torch", "ours"], required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=1, help="PowerSGD rank")
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    if a.world < 2 or a.width < 1 or a.layers < 1 or a.steps < 1 or a.timeout <= 0:
        ap.error("--world must be >= 2; --width, --layers, --steps and --timeout positive")
    params = a.layers * (a.width * a.width + a.width)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, a.world, port, a.hook, a.width, a.layers,
                                               a.steps, a.rank)) for r in range(a.world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + a.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    elapsed = time.monotonic() - t0
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if alive:
        outcome = f"hung ({len(alive)} of {a.world} ranks still running after {a.timeout:.0f} s)"
    elif any(c != 0 for c in codes):
        outcome = f"failed (exit codes {codes})"
    else:
        outcome = "completed"
    print(f"torch {torch.__version__}: {a.hook} powersgd r={a.rank}, {a.world} gloo ranks, "
          f"{params:,} parameters, default buckets, {a.steps} steps: {outcome} "
          f"in {elapsed:.1f} s", flush=True)
    return 0 if outcome == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
