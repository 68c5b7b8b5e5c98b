# SPDX-License-Identifier: Apache-2.0
"""The Python driver: runs a gradcomp plan (gradcomp/plan.hpp) over torch.distributed.

A plan is a step machine: ``plan.next()`` runs the next local phase (compress, decode, ...) in
C++ with the GIL released and returns the next collective, or None when the averaged gradient is
complete.

Ordering. Collectives of a process group must be issued in the same order on every rank. A plan
has several collectives, and DDP issues its own (e.g. the unused-parameter map with
``find_unused_parameters``); chaining the next collective from a completion callback lets ranks
interleave them differently, which deadlocks. So :class:`Worker` runs all plans of a hook on one
thread, bucket after bucket in the order DDP hands them over (the same on every rank), over a
process group of its own. The hook returns at once with a future the worker completes: the
backward pass is never blocked.

Threads. OpenMP's thread count (``torch.set_num_threads``, which sets it through the libgomp
that gradcomp shares with torch) is per thread: a new thread starts from the process default
(all cores unless OMP_NUM_THREADS is set), not from the caller's setting. The worker therefore
applies the thread count of the main thread to itself before each plan; without it, 4 ranks on
2 cores with ``torch.set_num_threads(1)`` ran our kernels with 2 spinning OpenMP threads per rank,
100x slower.

Errors. A plan's error completes its future with the exception (``fut.wait()`` raises it, type
and message intact). Inside a backward pass that would reach no one intact: DDP casts the value
of a failed hook future to a Tensor ("Unable to cast <message> to Tensor") and stops mid-step, so
the next step fails too. There the future completes with the bucket's own gradient and the error
is raised from an autograd final callback queued behind DDP's (:class:`AfterBackward`):
``loss.backward()`` raises the original exception and DDP can run its next step. A failed
collective (e.g. a peer that passed the process group's timeout) leaves the worker's group
unusable: later plans fail at once instead of waiting for the timeout again, bucket by bucket.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import queue
import weakref
import threading
import time
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("gradcomp")

_TORCH_TYPES = {
    "float32": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": None,
    "uint32": None,
    "int64": None,
}


# ---- torch.distributed across versions: public API where there is one -------------------------
def group_ranks(group) -> List[int]:
    """Global ranks of `group` (None: every rank), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))  # public since torch 1.13, our oldest


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (None: the default group)."""
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The timeout `group` (None: the default group) was made with, e.g. by
    ``init_process_group(timeout=...)``; None where this torch does not expose it. torch has no
    public getter: 1.13 keeps it in the gloo/NCCL group's options, 2.x in its backends'."""
    pg = dist.group.WORLD if group is None else group
    backends = [pg]
    get_backend = getattr(pg, "_get_backend", None)  # torch 2.x: backends behind a ProcessGroup
    if get_backend is not None:
        for dev in ("cpu", "cuda"):
            try:
                backends.append(get_backend(torch.device(dev)))
            except (RuntimeError, ValueError, TypeError):
                pass
    for b in backends:
        t = getattr(getattr(b, "options", None), "_timeout", None)
        if isinstance(t, datetime.timedelta):
            return t
    return None


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

    __slots__ = ("collectives", "bytes_sent", "wire_bytes", "local_seconds", "comm_seconds",
                 "tags", "events", "submitted", "started")

    def __init__(self) -> None:
        self.collectives = 0
        self.bytes_sent = 0
        self.wire_bytes = 0
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


class _Done:
    """What launch() returns for a collective made of several point-to-point works."""

    def __init__(self, works):
        self._works = works

    def wait(self):
        for w in self._works:
            w.wait()
        return None


def _all_to_all_p2p(recv: torch.Tensor, send: torch.Tensor, world: int, group) -> _Done:
    """all_to_all_single with equal parts, as one isend and one irecv per peer, all in flight
    at once. Part p of `send` goes to group rank p; part p of `recv` comes from it."""
    me = dist.get_rank(group)
    ins, outs = send.chunk(world), recv.chunk(world)
    outs[me].copy_(ins[me])
    works = []
    for p in range(world):
        if p == me:
            continue
        peer = global_rank(group, p)  # torch's point-to-point calls take global ranks
        works.append(dist.irecv(outs[p], src=peer, group=group))
        works.append(dist.isend(ins[p], dst=peer, group=group))
    return _Done(works)


def launch(c, group) -> torch.futures.Future:
    """Starts one collective asynchronously; returns an object whose wait() blocks until it is
    done (a torch Future, or _Done for an exchange made of point-to-point works)."""
    if c.send_bytes == 0:  # nothing to move (an empty bucket); gloo's all-to-all divides by it
        done = torch.futures.Future()
        done.set_result(None)
        return done
    send = _tensor(c.send(), c.type)
    recv = _tensor(c.recv(), c.type)
    kind = c.kind
    if kind == "allreduce":
        if not c.in_place:
            recv.copy_(send)
        if recv.dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
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
        work = dist.all_reduce(recv, op=dist.ReduceOp.SUM, group=group, async_op=True)
    elif kind == "allgather":
        send, recv = _as_bits(send), _as_bits(recv)
        outs = list(recv.chunk(c.world))
        work = dist.all_gather(outs, send, group=group, async_op=True)
    elif kind == "all-to-all":
        if c.send_bytes >= P2P_ALL_TO_ALL_BYTES * c.world and dist.get_backend(group) == "gloo":
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
    t0 = time.perf_counter()
    c = plan.next()
    t1 = time.perf_counter()
    stats.local_seconds += t1 - t0
    stats.events.append(("local", t0, t1))
    if c is not None:
        stats.collectives += 1
        stats.bytes_sent += c.send_bytes
        stats.wire_bytes += wire_bytes(c.kind, c.send_bytes, c.world)
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
        launch(c, group).wait()
        t1 = time.perf_counter()
        stats.comm_seconds += t1 - t0
        stats.events.append((c.tag, t0, t1))


class AfterBackward:
    """Where a plan run for a hook inside a backward pass puts its error (see "Errors" in the
    module docstring): the future's value is then `value` (the bucket's own gradient) and the
    error is raised by an autograd final callback that runs after every callback queued during
    the backward pass, DDP's finalize among them."""

    __slots__ = ("value", "error")

    def __init__(self, value) -> None:
        self.value, self.error = value, None

    @classmethod
    def arm(cls, value) -> Optional["AfterBackward"]:
        """A new one if a backward pass is running (None otherwise: errors go to the future)."""
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        if engine is None:
            return None
        a = cls(value)
        try:
            # queued now, this runs among the final callbacks, before or after DDP's; the
            # callback it queues runs after all of them
            engine.queue_callback(lambda: engine.queue_callback(a._raise))
        except RuntimeError:  # "Final callbacks can only be installed during backward pass"
            return None
        return a

    def _raise(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e


_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()  # closed at interpreter exit


_CLOSE = object()  # a close() request found while prefetching


class Worker:
    """Runs submitted plans one after another on a daemon thread (see the module docstring).

    Pipelining (``pipeline=True``, CPU buckets): while a plan's collective is on the wire, the
    worker takes the next queued bucket and runs its first local phase (compression), so that
    work overlaps the transfer instead of following it. Collectives keep their order: the next
    bucket's first collective is launched only after the current bucket has finished, so every
    rank still issues the same sequence; only when local work happens changes."""

    def __init__(self, group, name: str = "gradcomp-comm", pipeline: bool = True):
        self.group = group
        self.pipeline = bool(pipeline)
        self.num_threads = torch.get_num_threads()  # see "Threads" in the module docstring
        self._q: "queue.Queue" = queue.Queue()
        self._pending = None  # a job taken early by _prefetch (with its first step), or _CLOSE
        self.prefetched = 0  # buckets whose first local phase overlapped a previous transfer
        self._failed: Optional[BaseException] = None  # a collective failed: the group is unusable
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _workers.add(self)

    def submit(self, plan, result: Callable[[], torch.Tensor],
               done: Optional[Callable[[PlanStats], None]] = None,
               device: Optional[torch.device] = None,
               after_backward: Optional[AfterBackward] = None,
               failed: Optional[Callable[[BaseException], None]] = None) -> torch.futures.Future:
        """Queues a begun plan; the future's value is ``result()`` once the plan finished (after
        ``done(stats)``). An error calls ``failed(error)`` and completes the future with the
        exception, or, with `after_backward`, with ``after_backward.value`` and the error stored
        there."""
        stream = None
        if threading.current_thread() is threading.main_thread():
            self.num_threads = torch.get_num_threads()  # the user may have changed it
        if device is not None and device.type == "cuda":
            fut = torch.futures.Future(devices=[device])
            stream = torch.cuda.current_stream(device)
        else:
            fut = torch.futures.Future()
        self._q.put((plan, result, done, fut, stream, after_backward, time.perf_counter(), failed))
        return fut

    def _loop(self):
        threads = None
        while True:
            if self._pending is not None:
                job, self._pending = self._pending, None
            else:
                job = self._q.get()
            if job is None or job is _CLOSE:
                return
            plan, result, done, fut, stream, after, submitted, failed = job[:8]
            pre = job[8] if len(job) > 8 else None
            try:
                if threads != self.num_threads:
                    threads = self.num_threads
                    torch.set_num_threads(threads)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        value = self._run(plan, result, done, submitted)
                else:
                    value = self._run(plan, result, done, submitted, pre)
                fut.set_result(value)
            except BaseException as e:  # handed to whoever waits on the future, type intact
                if not isinstance(e, Exception):  # a Future carries Exceptions only
                    e = RuntimeError(f"gradcomp worker interrupted: {e!r}")
                if failed is not None:
                    try:
                        failed(e)
                    except Exception:  # bookkeeping must not hide the error itself
                        log.exception("gradcomp: error while recording a failed bucket")
                if after is not None:
                    after.error = e
                    fut.set_result(after.value)
                else:
                    fut.set_exception(e)
            # drop the references now: an idle thread must not keep the last plan alive
            job = plan = result = done = fut = stream = value = after = submitted = pre = None
            failed = None

    def close(self, timeout: float = 5.0) -> None:
        """Finishes the queued plans and stops the thread."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)

    def _run(self, plan, result, done, submitted=None, pre=None):
        if self._failed is not None:
            raise RuntimeError(f"gradcomp: an earlier collective of this hook failed, its process "
                               f"group is unusable: {self._failed}") from self._failed
        if pre is None:
            stats = PlanStats()
            stats.submitted, stats.started = submitted, time.perf_counter()
            c = _step(plan, stats)
        else:  # its first local phase ran while the previous bucket was on the wire
            stats, c, err = pre
            if err is not None:
                raise err
        while c is not None:
            try:
                t0 = time.perf_counter()
                work = launch(c, self.group)
                overlapped = self._prefetch()
                work.wait()
                t1 = time.perf_counter()
                # the next bucket's local work ran inside this wait: it is counted there
                stats.comm_seconds += max(0.0, t1 - t0 - overlapped)
                stats.events.append((c.tag, t0, t1))
            except Exception as e:
                self._failed = e
                raise
            c = _step(plan, stats)
        if done is not None:
            done(stats)
        return result()

    def _prefetch(self) -> float:
        """While a collective is in flight: takes the next queued CPU bucket, if any, and runs
        its first local phase; returns the seconds that took."""
        if not self.pipeline or self._pending is not None:
            return 0.0
        try:
            job = self._q.get_nowait()
        except queue.Empty:
            return 0.0
        if job is None:
            self._pending = _CLOSE
            return 0.0
        plan, stream, submitted = job[0], job[4], job[6]
        if stream is not None or self._failed is not None:  # CUDA: its stream context is _run's
            self._pending = job
            return 0.0
        t0 = time.perf_counter()
        stats = PlanStats()
        stats.submitted, stats.started = submitted, t0
        try:
            c, err = _step(plan, stats), None
        except Exception as e:  # the error belongs to that bucket's future, raised in its _run
            c, err = None, e
        self._pending = job + ((stats, c, err),)
        self.prefetched += 1
        return time.perf_counter() - t0


@atexit.register
def _close_workers() -> None:
    for w in list(_workers):
        w.close(timeout=1.0)
