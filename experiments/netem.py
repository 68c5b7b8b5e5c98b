# SPDX-License-Identifier: Apache-2.0
"""An emulated cluster on one machine (root): every rank in its own network namespace, joined to
a bridge by veth links limited to a rate (tc) in both directions; rank r at ``10.77.0.(r+1)`` on
interface ``gce<r>``. The namespaces are made by ``netns.sh`` beside this module and removed
whatever happens. Used by the Fashion-MNIST experiment and by experiments/ddp_hooks_bench.py (both
``--netns RATE``) and, for MPI, by experiments/netem/run.sh.

    python -m experiments.netem up PFX NP RATE   # what netns.sh does
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "netns.sh")
# the clone's root, where the package `experiments` is found: the ranks' commands run
# `python -m experiments.<name>`, which must resolve whatever directory the run started in
ROOT = os.path.dirname(HERE)
RANK0_ADDR = "10.77.0.1"


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("--netns needs root (network namespaces, tc): run with sudo")


def run_in_namespaces(world: int, rate: str, command_for_rank: Callable[[int], List[str]],
                      timeout: float, env: Optional[dict] = None,
                      per_node: int = 1) -> None:
    """Starts ``command_for_rank(r)`` for r < world, each inside its own namespace with links of
    ``rate`` (tc syntax: 1gbit, 10gbit) and the clone's root first on PYTHONPATH (so that
    ``python -m experiments.<name>`` finds this package); waits for all of them, at most
    ``timeout`` seconds in all. Raises RuntimeError when a rank fails or the time runs out (the
    remaining ranks are killed). The namespaces are removed in every case. The links have no
    added latency (this kernel has no netem): the ranks add it in their process group
    (experiments.latency).

    ``per_node`` > 1 emulates a two-level cluster: world / per_node namespaces (nodes), ranks
    r // per_node = node (node-major, as torchrun numbers them) sharing their node's namespace
    and its one shaped link (one network card per node); ranks of a node reach each other at the
    node's own address, which the kernel routes over loopback: unshaped. The ranks get
    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE."""
    require_root()
    if per_node < 1 or world % per_node:
        raise ValueError(f"per_node={per_node} does not divide the world size {world}")
    nodes = world // per_node
    pfx = f"gcx{os.getpid() % 100000}"
    subprocess.run(["bash", SCRIPT, "up", pfx, str(nodes), rate], check=True)
    procs: List[subprocess.Popen] = []
    try:
        for r in range(world):
            node = r // per_node
            e = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=f"gce{node}",
                     OMP_NUM_THREADS="1")
            e["PYTHONPATH"] = os.pathsep.join([ROOT, e["PYTHONPATH"]]) if e.get("PYTHONPATH") \
                else ROOT
            if per_node > 1:
                e.update(LOCAL_RANK=str(r % per_node), LOCAL_WORLD_SIZE=str(per_node))
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{pfx}{node}",
                                           *command_for_rank(r)], env=e))
        deadline = time.time() + timeout
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"rank {r} still running after {timeout:.0f} s: stopped") from None
            if rc != 0:
                raise RuntimeError(f"rank {r} exited with status {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["bash", SCRIPT, "down", pfx, str(nodes)], check=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return subprocess.run(["bash", SCRIPT, *(sys.argv[1:] if argv is None else argv)]).returncode


if __name__ == "__main__":
    sys.exit(main())
