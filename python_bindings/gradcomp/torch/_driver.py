# SPDX-License-Identifier: Apache-2.0
"""The Python driver: runs a gradcomp plan (gradcomp/plan.hpp) over torch.distributed.

A plan is a step machine: ``plan.next()`` runs the next local phase (compress, decode, ...) in
C++ with the GIL released and returns the next collective, or None when the averaged gradient is
complete.

Here: launching one collective on a process group (:func:`launch`, gloo's large all-to-all as
point-to-point sends), running a plan to its end (:func:`run_sync`) and its statistics
(:class:`PlanStats`). The thread that runs a hook's plans in bucket order is _worker.py; the
shims over torch.distributed's versions are _compat.py.
"""
from __future__ import annotations

import logging
import time
from typing import Optional
import numpy as np
import torch
import torch.distributed as dist

from ._compat import global_rank, group_ranks

log = logging.getLogger("gradcomp")

_TORCH_TYPES = {
    "float32": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": None,
    "uint32": None,
    "int64": None,
}


def _tensor(view, type_name: str) -> torch.Tensor:
    t = torch.from_numpy(view) if isinstance(view, np.ndarray) else view
    reinterpret = _TORCH_TYPES[type_name]
    return t.view(reinterpret) if reinterpret is not None else t


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors as bytes for collectives that only move data (all-to-all and
    allgather in equal parts): gloo moves neither bf16 nor int16 (torch 1.13)."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        return t
    if t.numel() == 0:  # an empty view may carry stride 0, which view() refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8)


def wire_bytes(kind: str, send_bytes: int, world: int) -> int:
    """Bytes one rank puts on its link for a collective whose send_bytes (Collective.send_bytes:
    the whole input of an allreduce or all-to-all, this rank's part of an allgather) are given,
    under the bandwidth-optimal algorithms: ring allreduce 2 (P-1)/P of the buffer, all-to-all
    the (P-1)/P of it that goes to other ranks, ring allgather (P-1) parts, broadcast the buffer
    once (pipelined). This, not send_bytes, is what a network-bound step pays: plain DDP's
    allreduce of B bytes moves 2 (P-1)/P B per rank, more than its input."""
    if world <= 1:
        return 0
    if kind == "allreduce":
        return 2 * (world - 1) * send_bytes // world
    if kind == "all-to-all":
        return (world - 1) * send_bytes // world
    if kind == "allgather":
        return (world - 1) * send_bytes
    if kind == "broadcast":
        return send_bytes
    raise ValueError(f"unknown collective {kind!r}")


class PlanStats:
    """Per-step accounting of one plan run: bytes handed to collectives (bytes_sent), bytes on
    this rank's link (wire_bytes, see wire_bytes()) and local compute time."""

    __slots__ = ("collectives", "bytes_sent", "wire_bytes", "cross_wire_bytes", "local_seconds",
                 "comm_seconds", "tags", "events", "submitted", "started")

    def __init__(self) -> None:
        self.collectives = 0
        self.bytes_sent = 0
        self.wire_bytes = 0
        self.cross_wire_bytes = 0  # wire_bytes less a hierarchical plan's inside-node collectives
        self.local_seconds = 0.0
        self.comm_seconds = 0.0  # launching and waiting for the collectives
        self.tags: list = []
        # the timeline of the run (time.perf_counter() seconds): (what, start, end) with what
        # "local" (a plan's local work) or a collective's tag; submitted = when the hook queued
        # the bucket, started = when the worker took it (the difference is the wait behind the
        # buckets before it)
        self.events: list = []
        self.submitted = self.started = None


# gloo's all_to_all_single took ~1.4x the time of the same exchange as concurrent isend/irecv
# pairs for 12.6 MB on 4 ranks with 1 Gbit/s links (124 vs 86 ms; bench/results/
# ddp_hooks_netns_*); for small messages its single call is faster (1.6 ms for 64 B). Bytes per
# peer from which the pairs are used:
P2P_ALL_TO_ALL_BYTES = 64 * 1024

# gloo's allgather is a ring: P - 1 message rounds one after the other, each paying the link's
# latency, where sending this rank's part to every peer at once (isend / irecv pairs, as for the
# all-to-all) pays it once for the same bytes on each link. Over loopback the pairs were faster
# at 14 of 15 sizes from 64 B to 4 MB per rank on 2 and 4 ranks (1.0-2.5x; 0.73x at 256 KB on 4)
# and, with 25 ms one way per round, 2.5-2.6x on 4 ranks (equal on 2, where the ring is one
# round too): experiments/results/auto_sweep_2026-11-28/allgather_p2p.md.
#: False: every allgather through gloo's own call (the A/B of the pairs)
P2P_ALLGATHER = True


# gloo's allreduce is a ring too: 2 (P - 1) message rounds. For a small fp32 buffer (PowerSGD's
# P and Q, auto's gathered measurements, a plan's small sums) the rounds cost and the bytes do
# not: up to this many bytes an allreduce on gloo goes as one allgather of every rank's buffer
# (isend/irecv pairs, one round, P/2 times the ring's bytes) and every rank sums the P buffers
# in rank order, one elementwise add at a time (the same bits on every rank, whatever its CPU).
# PowerSGD's two allreduces per bucket then pay the latency twice instead of 4 (P - 1) times.
#: 0: every allreduce through gloo's own call (the A/B of the pairs)
P2P_ALLREDUCE_BYTES = 256 * 1024


class _Done:
    """What launch() returns for a collective made of several point-to-point works."""

    def __init__(self, works):
        self._works = works

    def wait(self):
        for w in self._works:
            w.wait()
        return None


class _Summed:
    """An allreduce as an allgather of every rank's buffer (see P2P_ALLREDUCE_BYTES): wait()
    waits for the allgather's pairs, then writes the rank-ordered sum of the P rows of `every`
    into `out`."""

    def __init__(self, gathered: _Done, every: torch.Tensor, out: torch.Tensor):
        self._gathered, self._every, self._out = gathered, every, out

    def wait(self):
        self._gathered.wait()
        if self._every is not None:
            every, self._every = self._every, None
            self._out.copy_(every[0])
            for row in every[1:]:
                self._out.add_(row)
        return None


def _all_reduce_p2p(buf: torch.Tensor, world: int, group) -> _Summed:
    """An in-place allreduce-sum of `buf` (fp32, host memory) as one allgather of every rank's
    buffer and a rank-ordered sum (see P2P_ALLREDUCE_BYTES)."""
    flat = buf.reshape(-1)
    every = torch.empty(world, flat.numel(), dtype=flat.dtype, device=flat.device)
    return _Summed(_all_gather_p2p(every.view(-1), flat, world, group), every, flat)


def _sums_by_gather(c, recv: torch.Tensor, group) -> bool:
    """Whether allreduce c (its recv buffer, its own process group) goes as one allgather and a
    rank-ordered sum (see P2P_ALLREDUCE_BYTES) rather than by gloo's ring."""
    return (recv.dtype == torch.float32 and c.world > 1 and not recv.is_cuda
            and c.send_bytes <= P2P_ALLREDUCE_BYTES and recv.is_contiguous() and _gloo(group))


def _pairs(recv_parts, send_parts, group) -> _Done:
    """One irecv into recv_parts[p] from, and one isend of send_parts[p] to, every peer p of
    `group`, all in flight at once (this rank's own part is the caller's)."""
    me = dist.get_rank(group)
    works = []
    for p in range(len(recv_parts)):
        if p == me:
            continue
        peer = global_rank(group, p)  # torch's point-to-point calls take global ranks
        works.append(dist.irecv(recv_parts[p], src=peer, group=group))
        works.append(dist.isend(send_parts[p], dst=peer, group=group))
    return _Done(works)


def _all_to_all_p2p(recv: torch.Tensor, send: torch.Tensor, world: int, group) -> _Done:
    """all_to_all_single with equal parts, as one isend and one irecv per peer, all in flight
    at once. Part p of `send` goes to group rank p; part p of `recv` comes from it."""
    ins, outs = send.chunk(world), recv.chunk(world)
    outs[dist.get_rank(group)].copy_(ins[dist.get_rank(group)])
    return _pairs(outs, ins, group)


def _all_gather_p2p(recv: torch.Tensor, send: torch.Tensor, world: int, group) -> _Done:
    """all_gather of equal parts as one isend of `send` to every peer and one irecv from each,
    all in flight at once: part p of `recv` comes from group rank p."""
    outs = recv.chunk(world)
    outs[dist.get_rank(group)].copy_(send)
    return _pairs(outs, [send] * world, group)


def _gloo(group) -> bool:
    """Whether `group` is gloo's, or a wrapper of gloo registered as "gloo_<name>" (the
    experiments' latency emulation): the CPU paths below are gloo's."""
    name = str(dist.get_backend(group))
    return name == "gloo" or name.startswith("gloo_")


def _p2p_allgather(send: torch.Tensor, group) -> bool:
    """Whether an allgather goes as point-to-point pairs (see P2P_ALLGATHER): on gloo, for host
    memory (gloo's send/recv hand the pointer to its transport as host memory)."""
    return P2P_ALLGATHER and not send.is_cuda and _gloo(group)


class Topology:
    """The process groups of a two-level job for a hierarchical plan: ``node`` (this rank's node,
    local ranks in order) and ``cross`` (this rank's local rank on every node, nodes in order),
    beside ``world``. Ranks are node-major, as torchrun numbers them: node = rank // per_node."""

    def __init__(self, world, per_node: int, timeout=None):
        ranks = group_ranks(world)
        P = len(ranks)
        if per_node < 1 or P % per_node:
            raise ValueError(f"per_node={per_node} does not divide the world size {P}")
        me = dist.get_rank(world)
        kw = {} if timeout is None else {"timeout": timeout}
        backend = dist.get_backend(world)
        self.world, self.per_node, self.nodes = world, per_node, P // per_node
        self.node = self.cross = None
        # every rank creates every group, in the same order (new_group is collective); groups of
        # one rank are never used (no node collectives with one rank per node, no cross ones
        # with one node)
        if per_node > 1:
            for n in range(self.nodes):
                g = dist.new_group(ranks=ranks[n * per_node:(n + 1) * per_node], backend=backend,
                                   **kw)
                if me // per_node == n:
                    self.node = g
        if self.nodes > 1:
            for i in range(per_node):
                g = dist.new_group(ranks=ranks[i::per_node], backend=backend, **kw)
                if me % per_node == i:
                    self.cross = g

    def group(self, scope: str):
        g = {"world": self.world, "node": self.node, "cross": self.cross}[scope]
        if g is None:  # pragma: no cover - a plan of another layout
            raise RuntimeError(f"gradcomp: a {scope} collective in a layout without {scope} "
                               f"groups ({self.nodes} nodes x {self.per_node})")
        return g


def _group_for(c, group):
    """The process group that runs collective c: a Topology's node or cross group for a
    hierarchical plan's collectives, else the group itself."""
    scope = _scope(c)
    if isinstance(group, Topology):
        return group.group(scope)
    if scope != "world":
        raise RuntimeError(f"gradcomp: a hierarchical plan's {scope} collective was given a "
                           f"flat process group (build the hook with hierarchy='node')")
    return group


def _scope(c) -> str:
    """A collective's scope ("world" for collectives made in Python, which have none)."""
    return getattr(c, "scope", "world")


def launch(c, group, stats: Optional[PlanStats] = None) -> torch.futures.Future:
    """Starts one collective asynchronously; returns an object whose wait() blocks until it is
    done (a torch Future, or _Done for an exchange made of point-to-point works). `group`: a
    process group, or a Topology for a hierarchical plan (each collective's scope picks).
    `stats`: counts the collective's wire bytes by the route taken here (a small allreduce summed
    by an allgather puts P - 1 buffers on the link, not the ring's 2 (P - 1) / P of one)."""
    group = _group_for(c, group)
    if c.send_bytes == 0:  # nothing to move (an empty bucket); gloo's all-to-all divides by it
        done = torch.futures.Future()
        done.set_result(None)
        return done
    send = _tensor(c.send(), c.type)
    recv = _tensor(c.recv(), c.type)
    kind = c.kind
    summed = kind == "allreduce" and _sums_by_gather(c, recv, group)
    if stats is not None:
        wire = wire_bytes("allgather" if summed else kind, c.send_bytes, c.world)
        stats.wire_bytes += wire
        if _scope(c) != "node":  # what crosses the network between nodes (all of it when flat)
            stats.cross_wire_bytes += wire
    if kind == "allreduce":
        if not c.in_place:
            recv.copy_(send)
        if recv.dtype == torch.bfloat16 and _gloo(group):
            # gloo (torch 1.13) has no bf16 reductions: sum in fp32, round once; every rank
            # rounds the same fp32 sum, so the result stays identical across ranks
            wide = recv.float()
            fut = dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group,
                                  async_op=True).get_future()

            def narrow(f):
                f.wait()
                recv.copy_(wide)
                return [recv]

            return fut.then(narrow)
        if summed:
            return _all_reduce_p2p(recv, c.world, group)
        work = dist.all_reduce(recv, op=dist.ReduceOp.SUM, group=group, async_op=True)
    elif kind == "allgather":
        send, recv = _as_bits(send), _as_bits(recv)
        if _p2p_allgather(send, group):
            return _all_gather_p2p(recv, send, c.world, group)
        outs = list(recv.chunk(c.world))
        work = dist.all_gather(outs, send, group=group, async_op=True)
    elif kind == "all-to-all":
        # (CPU only: gloo's send/recv hand the tensor's pointer to its TCP transport as host
        # memory, while its all_to_all_single stages CUDA tensors through pinned host memory)
        if (c.send_bytes >= P2P_ALL_TO_ALL_BYTES * c.world and not send.is_cuda
                and _gloo(group)):
            return _all_to_all_p2p(_as_bits(recv), _as_bits(send), c.world, group)
        work = dist.all_to_all_single(_as_bits(recv), _as_bits(send), group=group,
                                      async_op=True)
    elif kind == "broadcast":
        if dist.get_rank(group) == c.root:
            recv.copy_(send)
        src = global_rank(group, c.root)
        work = dist.broadcast(recv, src=src, group=group, async_op=True)
    else:  # pragma: no cover - the C++ vocabulary is closed
        raise RuntimeError(f"unknown collective {kind!r}")
    return work.get_future()


def _step(plan, stats: PlanStats):
    """The plan's next local phase; counts its collective (if any) in stats (its wire bytes:
    launch(), which picks the route)."""
    t0 = time.perf_counter()
    c = plan.next()
    t1 = time.perf_counter()
    stats.local_seconds += t1 - t0
    stats.events.append(("local", t0, t1))
    if c is not None:
        stats.collectives += 1
        stats.bytes_sent += c.send_bytes
        stats.tags.append(c.tag)
    return c


def run_sync(plan, group) -> PlanStats:
    """Runs a begun plan to completion, blocking (for tools and tests)."""
    stats = PlanStats()
    while True:
        c = _step(plan, stats)
        if c is None:
            return stats
        t0 = time.perf_counter()
        launch(c, group, stats).wait()
        t1 = time.perf_counter()
        stats.comm_seconds += t1 - t0
        stats.events.append((c.tag, t0, t1))
