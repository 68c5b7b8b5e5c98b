# SPDX-License-Identifier: Apache-2.0
"""Spawning gloo ranks on one machine: what the experiments and the test suite share."""
import importlib.util
import multiprocessing
import os
import socket
import sys


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_rank() -> None:
    """Ends a spawned rank without interpreter teardown, once everything is written: torch 1.13
    can deadlock when a DDP reducer holds the last reference to a gloo process group (its worker
    thread waits for the GIL the destructor holds), and torch 2.15 + gloo aborted a rank at
    teardown ("terminate called without an active exception") in 2 of 50 runs of a DDP job, 0 of
    50 ending here (2026-11-24)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _preload() -> list:
    """What the fork server imports once for every rank it forks: torch and its distributed
    package, and on torch 2.x torch._dynamo (with sympy, about 900 modules), which the first
    DistributedDataParallel(...) of a process imports. A fresh interpreter spends 4.7 s here on
    importing torch 2.x and 2.1 s more on that first DDP (torch 1.13: 0.05 s); forked from the
    server a rank starts in 0.1 s."""
    mods = ["torch", "torch.distributed", "torch.nn.parallel"]
    if importlib.util.find_spec("torch._dynamo") is not None:
        mods.append("torch._dynamo")
    return mods


def rank_context():
    """multiprocessing's fork-server context with the preload of _preload(): for a caller that
    starts and watches its rank processes itself (ctx.Process(target=..., args=...))."""
    multiprocessing.set_forkserver_preload(_preload())
    return multiprocessing.get_context("forkserver")


def start_ranks(fn, args: tuple, nprocs: int, join: bool = True):
    """Runs fn(rank, *args) in `nprocs` processes forked from multiprocessing's fork server (see
    _preload): each rank is a fresh process that imported nothing but the preloaded modules, as
    torchrun's are, without each paying for the import. The server is started once per process,
    with the environment of that moment: a rank sees environment variables set before the first
    call, not later ones (pass what changes in `args`). Returns torch.multiprocessing's context
    (join=False) or raises the first failing rank's exception (join=True), as mp.spawn does."""
    import torch.multiprocessing as mp

    rank_context()  # (the server's preload)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
