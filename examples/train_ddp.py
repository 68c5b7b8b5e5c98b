# SPDX-License-Identifier: Apache-2.0
"""DDP training with a gradcomp hook: one process per GPU (or per CPU rank without CUDA).

    torchrun --nproc_per_node=N examples/train_ddp.py [--compressor auto] [--steps S]

docs/MULTI_GPU.md has the command lines for one node and for several, and what a GPU run needs.
"""
import argparse
import datetime
import os
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp.torch as gt

# topk and onebit apply SGD's momentum inside the hook, before compressing (what each rank leaves
# out is remembered with its momentum); the optimizer must then have none, or it would apply
# the momentum twice (docs/USAGE.md, "Momentum"). The other compressors use the optimizer's own.
HOOK_OPTIONS = {"topk": {"ratio": 0.01, "momentum": 0.9}, "onebit": {"momentum": 0.9}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compressor", default="auto", choices=sorted(gt.COMPRESSORS) + ["auto"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hierarchy", choices=["node"], default=None,
                   help="several nodes: full precision inside a node, compressed across nodes")
    p.add_argument("--checkpoint", default="train_ddp.pt", help="written by rank 0 at the end")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective waits for a peer before the job fails")
    args = p.parse_args()

    # torchrun sets these (and MASTER_ADDR/MASTER_PORT, which init_method="env://" reads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its node
    if torch.cuda.is_available():
        # one process per GPU; set_device before anything touches CUDA, so that NCCL and the
        # object collectives below use this rank's GPU and not GPU 0
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # without it a dead peer leaves the others waiting for torch's default, 30 minutes
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, init_method="env://", timeout=timeout)

    torch.manual_seed(0)  # the same initial model and target on every rank
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    teacher = torch.nn.Linear(32, 10).to(device)  # synthetic labels: argmax of a fixed map
    model = DDP(net.to(device), device_ids=[local_rank]) if device.type == "cuda" else DDP(net)

    opts = HOOK_OPTIONS.get(args.compressor, {})
    # hierarchy="node" takes the node size from LOCAL_WORLD_SIZE, which torchrun sets
    state, hook = gt.hook(args.compressor, model=model, timeout=timeout,
                          hierarchy=args.hierarchy, **opts)
    model.register_comm_hook(state, hook)
    if "momentum" in opts:
        opt = gt.dgc_optimizer(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own share of the data
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 32, generator=data).to(device)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP hands each gradient bucket to the hook here
        opt.step()
        if rank == 0 and (step == 1 or step % max(1, args.steps // 10) == 0):
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    # every rank keeps its own residuals and momenta: gather them all into rank 0's checkpoint
    # (collective), which then resumes on any number of ranks (docs/USAGE.md, "Checkpoints")
    hook_state = gt.gather_state_dict(state)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "hook": hook_state, "step": args.steps}, args.checkpoint)
        print(f"final loss {loss.item():.4f}; checkpoint {args.checkpoint}", flush=True)
        t = state.totals
        if world == 1:  # one rank has no peer: nothing goes on the wire, no ratio to report
            print(f"{args.compressor}: one rank, nothing sent", flush=True)
        else:
            print(f"{args.compressor}: {t['dense_bytes'] / max(1, t['wire_bytes']):.1f}x fewer "
                  f"bytes on the wire than the dense gradients", flush=True)
        if args.compressor == "auto":  # what it measured and picked, per DDP bucket
            print(f"auto chose {state.choices}", flush=True)

    # DDP keeps the replicas in step only if every rank received the same average: compare
    # a checksum of every parameter's bits across the ranks
    flat = torch.cat([q.detach().reshape(-1).cpu() for q in model.parameters()])
    mine = torch.tensor([zlib.crc32(flat.numpy().tobytes())], dtype=torch.int64, device=device)
    sums = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sums, mine)
    same = all(torch.equal(s, mine) for s in sums)
    if rank == 0:
        print(f"parameters bitwise identical on all {world} ranks: {same}", flush=True)
    # The end of the job, in this order while `sums` and `mine` still hold the last collective's
    # tensors. The hook first: close() stops its thread and releases the process groups it made,
    # which would otherwise live until the interpreter shuts down and be destroyed then, when a
    # thread of gloo that frees a tensor Python saw ends the process ("terminate called without
    # an active exception"). Then torch's groups; the DDP model holds the last reference to the
    # default one, so it goes with the model: gloo's destructor joins gloo's threads holding the
    # GIL, and one of them may still be dropping the last collective's tensors, which needs the
    # GIL (a hang at exit on torch 1.13, 2 of 4 runs here) unless they are still held here.
    state.close()
    dist.destroy_process_group()
    del model, state, hook
    if not same:
        raise SystemExit(f"rank {rank}: parameter checksums differ across ranks: "
                         f"{[int(s) for s in sums]}")


if __name__ == "__main__":
    main()
