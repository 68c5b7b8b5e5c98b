# SPDX-License-Identifier: Apache-2.0
"""The 1-bit hook's local work per step with and without the block rotation, one rank, one
thread, no link (a 1-rank gloo group on loopback): the issue-12 MLP (6 x Linear(1024, 1024), 25 MB
buckets), 15 steps, median of steps 5-14 of state.history. Usage (from the clone's root):
python -m experiments.onebit_rotation_local (port 29611 must be free)."""
import os
import statistics
os.environ["OMP_NUM_THREADS"] = "1"
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
import gradcomp.torch as gt
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29611", rank=0, world_size=1)
for rotate in (False, True, False, True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    m = DDP(net, bucket_cap_mb=25)
    st, hk = gt.hook("onebit", model=m, rotate=rotate)
    m.register_comm_hook(st, hk)
    x = torch.randn(4, 1024); y = torch.randn(4, 1024)
    for _ in range(15):
        m.zero_grad(); torch.nn.functional.mse_loss(m(x), y).backward()
    h = st.history[5:]
    print("rotate", rotate, "local ms/step median", round(1e3 * statistics.median(x["local_seconds"] for x in h), 2),
          "comm", round(1e3 * statistics.median(x["comm_seconds"] for x in h), 2))
    if st._worker is not None: st._worker.close()
os._exit(0)
