# SPDX-License-Identifier: Apache-2.0
"""The thread that runs all of a hook's plans, bucket after bucket (:class:`Worker`), and where
an error of a plan run inside a backward pass goes (:class:`AfterBackward`).

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
import logging
import queue
import threading
import time
import weakref
from typing import Callable, Optional

import torch

from ._driver import PlanStats, _step, launch

log = logging.getLogger("gradcomp")


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
        self._held: list = []  # jobs submitted with hold=True, queued by the next unheld one
        self._held_lock = threading.Lock()
        self._pending = None  # a job taken early by _prefetch (with its first step), or _CLOSE
        self.prefetched = 0  # buckets whose first local phase overlapped a previous transfer
        self._failed: Optional[BaseException] = None  # a collective failed: the group is unusable
        self._streams: dict = {}  # device index -> the side stream of this worker's CUDA plans
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _workers.add(self)

    def side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The stream this worker's CUDA plans run on, one per device, made on first use (the
        hook orders it after the submitting stream for each bucket)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return s

    def submit(self, plan, result: Callable[[], torch.Tensor],
               done: Optional[Callable[[PlanStats], None]] = None,
               device: Optional[torch.device] = None,
               after_backward: Optional[AfterBackward] = None,
               failed: Optional[Callable[[BaseException], None]] = None,
               hold: bool = False) -> torch.futures.Future:
        """Queues a begun plan; the future's value is ``result()`` once the plan finished (after
        ``done(stats)``). An error calls ``failed(error)`` and completes the future with the
        exception, or, with `after_backward`, with ``after_backward.value`` and the error stored
        there. ``hold=True`` keeps the plan back until the next plan submitted without it (or
        :meth:`release`), which queues the held ones first, in their order: a hook built with
        ``overlap=False`` holds every bucket but the step's last, so that nothing is sent before
        backward has finished (the structure of an exchange run after backward)."""
        stream = None
        if threading.current_thread() is threading.main_thread():
            self.num_threads = torch.get_num_threads()  # the user may have changed it
        if device is not None and device.type == "cuda":
            fut = torch.futures.Future(devices=[device])
            stream = torch.cuda.current_stream(device)
        else:
            fut = torch.futures.Future()
        job = (plan, result, done, fut, stream, after_backward, time.perf_counter(), failed)
        with self._held_lock:
            if hold:
                self._held.append(job)
            else:
                self._release_locked()
                self._q.put(job)
        return fut

    def release(self) -> None:
        """Queues the held plans (e.g. when the step's last bucket failed before it was
        submitted: a held plan's future must still complete, DDP waits for it)."""
        with self._held_lock:
            self._release_locked()

    def _release_locked(self) -> None:
        for job in self._held:
            self._q.put(job)
        self._held.clear()

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
                    # set inside the stream's context: the future records its completion on
                    # that stream, and a consumer's wait orders the consumer's stream after it
                    with torch.cuda.stream(stream):
                        value = self._run(plan, result, done, submitted)
                        fut.set_result(value)
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

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Finishes the queued plans and stops the thread (waits at most `timeout` seconds;
        None: until it has stopped, which a collective's own timeout bounds). Once the thread
        has stopped, the process groups are released here, in the caller's thread: gloo's
        destructor joins gloo's threads, and run late, from an interpreter that is shutting
        down, a gloo thread that needs the interpreter (to free a tensor Python saw) ends the
        process."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.group = None

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
                work = launch(c, self.group, stats)
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
