# SPDX-License-Identifier: Apache-2.0
"""One rank of test_hook_hardening's hung-peer test (run as a script, not collected by pytest).

    python hung_peer.py RANK PORT USER_TIMEOUT_S HOOK_TIMEOUT_S|none D_HIDDEN

Two gloo ranks train a DDP model with the top-k hook (compressing from iteration 1, after DDP
rebuilt its buckets: D_HIDDEN 600 gives it several). In iteration 1 rank 1 stops itself
(SIGSTOP) before its backward pass, as a hung peer would; rank 0 runs its backward and prints
one JSON line: the seconds until backward() returned or raised, the error, and how many buckets
the hook was given in that iteration."""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp.torch as gt
from ddp_util import Net


def main(rank: int, port: int, user_timeout: float, hook_timeout: str, d_hidden: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=user_timeout))
    model = DDP(Net(d_hidden=d_hidden), bucket_cap_mb=1)
    kw = {} if hook_timeout == "none" else {
        "timeout": datetime.timedelta(seconds=float(hook_timeout))}
    state, hook = gt.hook("topk", ratio=0.1, start_iter=1, **kw)
    buckets = []

    def counted(state, bucket):
        buckets.append(bucket.index())
        return hook(state, bucket)

    model.register_comm_hook(state, counted)
    model(torch.randn(4, 32)).sum().backward()  # iteration 0: plain allreduce, bucket rebuild
    buckets.clear()
    loss = model(torch.randn(4, 32)).sum()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills this process
        time.sleep(3600)
    t0 = time.monotonic()
    try:
        loss.backward()
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"elapsed": time.monotonic() - t0, "error": error, "buckets": len(buckets)}),
          flush=True)
    os._exit(0)  # no teardown: the peer is stopped


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
