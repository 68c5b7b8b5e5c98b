# SPDX-License-Identifier: Apache-2.0
"""Link latency for the emulated clusters, where the kernel has no netem.

This machine's kernel offers only the tbf and htb qdiscs (``tc qdisc add ... netem`` fails with
"qdisc kind is unknown"), so the namespaces of :mod:`experiments.netem` can limit a
link's rate but cannot delay its packets. The latency is added one level up instead, where every
method sees it alike: a process group backend, ``gloo_latency``, that wraps gloo and holds each
collective back for the link's one-way latency once per sequential message round of the
collective's algorithm before gloo moves its bytes (over links whose rate tbf limits). A
collective of ``k`` rounds moving ``b`` bytes then takes ``k * latency + (what gloo takes for b
bytes)``: the alpha-beta model with alpha = the one-way latency per round. Plain DDP, PyTorch's
own comm hooks and gradcomp's hooks issue their collectives through the same group, so they pay
the same latency per round; a plan with more rounds per bucket pays it more often, as it would
on a real link.

Rounds per collective (``rounds()``), as the textbook algorithms over P ranks have them: ring
allreduce 2(P - 1); ring allgather and reduce-scatter P - 1; binomial-tree broadcast and reduce
and dissemination barrier ceil(log2 P); pairwise all-to-all, direct gather and scatter 1 (every
pair at once); send / recv 1. The scale model (gradcomp.scale) counts the same for allreduce
and allgather, and P - 1 for all-to-all (a pairwise exchange; gloo posts every pair at once).
experiments/latency_check.py measures what the emulation gives against the alpha-beta model,
tests/python/test_latency.py checks it.

Use: ``register(latency_s)`` in every rank before ``init_process_group("gloo_latency", ...)``;
subgroups made with ``dist.new_group(...)`` get the same latency (with ``per_node``, none inside
one node). The group keeps the order of
collectives (one release queue per group), which gloo needs on every rank alike. Needs torch 2.x
(a process group written in Python, with futures, is what DDP's reducer can call); on torch 1.13
``register`` raises RuntimeError saying so.
"""
from __future__ import annotations

import collections
import math
import re
import threading
import time
from typing import Any, Callable, Optional, Sequence

BACKEND = "gloo_latency"
_latency_s: Optional[float] = None


def rounds(kind: str, world: int) -> int:
    """Sequential message rounds of collective `kind` over `world` ranks (see the module's
    docstring); 0 for one rank (nothing travels)."""
    if world < 1:
        raise ValueError(f"world={world}: at least one rank")
    if world == 1:
        return 0
    log2 = math.ceil(math.log2(world))
    table = {"allreduce": 2 * (world - 1), "allgather": world - 1, "reduce_scatter": world - 1,
             "broadcast": log2, "reduce": log2, "barrier": log2, "alltoall": 1, "gather": 1,
             "scatter": 1, "send": 1, "recv": 1}
    if kind not in table:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(sorted(table))}")
    return table[kind]


def _torch_supports_python_groups() -> bool:
    import torch

    return int(torch.__version__.split(".")[0]) >= 2


class _Releaser:
    """One thread per group that starts each collective at its release time, in the order the
    collectives were issued (gloo matches collectives by order on every rank)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (release time, start), in order
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gloo-latency", daemon=True)
        self._thread.start()

    def submit(self, delay_s: float, start: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the latency group was shut down")
            self._queue.append((time.monotonic() + delay_s, start))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                release, start = self._queue[0]
                now = time.monotonic()
                if release > now:  # the head waits; later ones wait behind it (order kept)
                    self._cv.wait(release - now)
                    continue
                self._queue.popleft()
            start()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def _make_group_class():
    import torch
    import torch.distributed as dist

    class _Work(dist.Work):
        def __init__(self, fut: "torch.futures.Future") -> None:
            super().__init__()
            self._fut = fut

        def wait(self, timeout=None) -> bool:
            self._fut.wait()
            return True

        def is_completed(self) -> bool:
            return self._fut.done()

        def is_success(self) -> bool:
            if not self._fut.done():
                return False
            try:
                self._fut.value()
            except Exception:
                return False
            return True

        def get_future(self) -> "torch.futures.Future":
            return self._fut

        def result(self):
            return self._fut.value()

    class GlooWithLatency(dist.ProcessGroup):
        """gloo with `latency_s` one-way latency per message round (see the module)."""

        def __init__(self, inner: Any, latency_s: float) -> None:
            super().__init__(inner.rank(), inner.size())
            self._inner = inner
            self._latency_s = latency_s
            self._releaser = _Releaser()

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return BACKEND

        @property
        def latency_s(self) -> float:
            return self._latency_s

        @property
        def options(self):  # gloo's (its timeout: what gradcomp's hooks read for theirs)
            return self._inner.options

        def _off_releaser(self, complete: Callable[[], None]) -> None:
            """Runs `complete` (which completes a caller's future, and so runs the caller's
            continuations) anywhere but on the releaser thread: a continuation may issue the
            next collective and wait for it inside (PyTorch's PowerSGD hook does), and only the
            releaser can start that one. gloo's own threads, where most completions arrive,
            are free to run it, as they are without the latency."""
            if threading.current_thread() is self._releaser._thread:
                threading.Thread(target=complete, name="gloo-latency-done", daemon=True).start()
            else:
                complete()

        def _issue(self, kind: str, start: Callable[[], Any]) -> "_Work":
            fut: torch.futures.Future = torch.futures.Future()

            def begin() -> None:
                try:
                    work = start()
                except Exception as e:  # a refusal by gloo reaches the caller's future
                    self._off_releaser(lambda e=e: fut.set_exception(e))
                    return
                try:
                    inner_fut = work.get_future()
                except RuntimeError:  # gloo's send / recv have no future: a thread waits
                    def wait_then_set() -> None:
                        try:
                            work.wait()
                            fut.set_result([])
                        except Exception as e:
                            fut.set_exception(e)

                    threading.Thread(target=wait_then_set, daemon=True).start()
                    return

                def complete(f: "torch.futures.Future") -> None:
                    try:
                        fut.set_result(f.value())
                    except Exception as e:
                        fut.set_exception(e)

                # a collective gloo finished before this line calls back at once, here, on the
                # releaser thread
                inner_fut.add_done_callback(lambda f: self._off_releaser(lambda: complete(f)))

            self._releaser.submit(rounds(kind, self.size()) * self._latency_s, begin)
            return _Work(fut)

        def shutdown(self) -> None:
            self._releaser.close()

    # Every collective gloo offers, under the names of torch 1.x/2.0 (_allgather_base,
    # alltoall_base) and of later 2.x (all_gather_single, all_to_all_single): each forwards its
    # arguments unchanged to the same method of the gloo group, released after its rounds.
    for name, kind in _METHODS.items():
        def method(self, *args, _name=name, _kind=kind, **kwargs):
            return self._issue(_kind, lambda: getattr(self._inner, _name)(*args, **kwargs))

        method.__name__ = name
        setattr(GlooWithLatency, name, method)
    return GlooWithLatency


_METHODS = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce",
    "allgather": "allgather", "allgather_coalesced": "allgather", "_allgather_base": "allgather",
    "all_gather_single": "allgather", "all_gather_single_coalesced": "allgather",
    "allgather_into_tensor_coalesced": "allgather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "alltoall", "alltoall_base": "alltoall", "all_to_all_single": "alltoall",
    "broadcast": "broadcast", "barrier": "barrier", "reduce": "reduce", "gather": "gather",
    "gather_single": "gather", "scatter": "scatter", "send": "send", "recv": "recv",
    "recv_anysource": "recv",
}


_group_class = None
_per_node = 1


def parse_delay(text: str) -> float:
    """A one-way latency as the experiments' ``--delay`` takes it ("100us", "5ms", "0.05s" or
    plain seconds; "" or "0" for none), in seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?\s*", str(text or "0"))
    if not m:
        raise ValueError(f"delay {text!r}: a number with us, ms or s (e.g. 100us, 5ms)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


def backend_for(delay: str, per_node: int = 1) -> str:
    """The backend an experiment's rank passes to init_process_group for ``--delay``: "gloo"
    without one, else ``gloo_latency`` (registered here with that latency)."""
    lat = parse_delay(delay)
    if lat == 0.0:
        return "gloo"
    register(lat, per_node=per_node)
    return BACKEND


def _within_one_node(global_ranks: Sequence[int], world: int) -> bool:
    ranks = list(global_ranks) or list(range(world))
    return _per_node > 1 and len({r // _per_node for r in ranks}) == 1


def register(latency_s: float, per_node: int = 1) -> None:
    """Registers the backend ``gloo_latency`` with a one-way latency of `latency_s` seconds per
    message round, for this process (every rank calls it before init_process_group). With
    `per_node` > 1 (a two-level cluster, ranks numbered node-major) a group whose ranks all sit
    in one node gets no latency: its traffic never crosses the slow link. A second call changes
    the latency of groups made afterwards."""
    global _latency_s, _group_class, _per_node
    if not (isinstance(latency_s, (int, float)) and not isinstance(latency_s, bool)
            and math.isfinite(latency_s) and latency_s >= 0):
        raise ValueError(f"latency_s={latency_s!r}: a finite number of seconds >= 0")
    if not (isinstance(per_node, int) and per_node >= 1):
        raise ValueError(f"per_node={per_node!r}: a positive int")
    if not _torch_supports_python_groups():
        import torch

        raise RuntimeError(f"the latency emulation needs torch 2.x (process groups written in "
                           f"Python); this is torch {torch.__version__}")
    import torch.distributed as dist

    _latency_s = float(latency_s)
    _per_node = per_node
    if _group_class is None:
        _group_class = _make_group_class()

        def create(opts, backend_options):
            inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size,
                                          opts.timeout)
            ranks = list(opts.global_ranks_in_group or [])
            world = dist.get_world_size() if dist.is_initialized() else opts.group_size
            lat = 0.0 if _within_one_node(ranks, world) else _latency_s
            return _group_class(inner, lat)

        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
