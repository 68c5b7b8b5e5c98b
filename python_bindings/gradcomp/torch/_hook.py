# SPDX-License-Identifier: Apache-2.0
"""The state of a gradcomp DDP hook (:class:`GradcompState`: options, per-bucket plans, the
step record, checkpoints) and the hook itself (:func:`_hook`), for every compressor but "auto"
(which runs these per candidate, see _auto.py)."""
import collections
import datetime
import logging
import math
import os
import threading
import time
import zlib
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ._buckets import BucketTable, _as_int, _Bucket, _CompositePlan
from ._compat import group_ranks, group_timeout
from ._driver import PlanStats, Topology, _all_gather_p2p, _p2p_allgather
from ._worker import AfterBackward, Worker
from ._families import COMPRESSORS
from ._reshard import is_gathered, local_state_dict, whole_or_none
from ._stats import TIMELINE_RUNS, HookStats

log = logging.getLogger("gradcomp")


class BucketTransform:
    """The one point where something outside the hook changes a bucket before it is compressed
    (1-bit Adam's optimizer divides the gradients by its frozen denominators there). Set
    ``state.bucket_transform`` to an object with these two methods (this class documents them; any
    object that has them will do):

    - ``check_step(iteration)``: once per step (at its first bucket), the warm-up's included,
      before anything is sent; raising refuses the step on every rank, every bucket of it
      (``loss.backward()`` raises this rank's error here, a ValueError naming the refusing ranks
      on the others). The verdicts travel in one small allgather per step.
    - ``before_compress(bucket)``: on the steps the compressor runs (not the warm-up's plain
      allreduce), with DDP's ``GradBucket``, before the plan reads it; change the gradients in
      place (``bucket.gradients()``).

    The hook knows nothing else of it: it is not saved with the hook's state (the object keeps
    its own), and every rank must set one (the first step's agreement refuses a job where only
    some do). ``hook("auto")`` takes none."""

    def check_step(self, iteration: int) -> None:
        pass

    def before_compress(self, bucket) -> None:
        pass


class GradcompState:
    """State of a gradcomp DDP hook: options, per-bucket plans, iteration, statistics.

    Pickling (``__getstate__``) and :meth:`state_dict` keep everything but the process group, so a
    checkpoint restores residuals, momenta, Q and errors exactly. Pass ``model`` (the DDP module
    or the wrapped module) so that state is matched to parameters, not to DDP's bucket order: a
    restored job's first iteration runs before DDP rebuilds its buckets, in another order.
    """

    def __init__(self, compressor: str, process_group=None, start_iter: Optional[int] = None,
                 log_every: int = 0, model=None, timeout=None, pipeline: bool = True,
                 **options):
        lazy = options.pop("_lazy", False)  # unpickling: the worker is made at first use
        hierarchy, per_node = options.pop("hierarchy", None), options.pop("per_node", None)
        overlap = options.pop("overlap", True)
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        if compressor not in COMPRESSORS:
            raise ValueError(f"unknown compressor {compressor!r}; choose one of {sorted(COMPRESSORS)}")
        fam = COMPRESSORS[compressor]
        live = dist.is_available() and dist.is_initialized()
        self.hierarchy = hierarchy
        self.per_node = _layout(hierarchy, per_node, process_group if live else False)
        self._per_node_given = per_node
        # (without a process group yet the layout is checked against the world size at first use)
        world = dist.get_world_size(process_group) if live else 1
        fam.validate(options, world, process_group, self.per_node if live else 0)
        self.timeout = _as_timeout(timeout)
        if not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be True or False, got {pipeline!r}")
        self.pipeline = pipeline
        # False: no bucket is sent before the step's last one was handed over (the exchange runs
        # after backward, as an optimizer-side compressed allreduce would); for measurements
        self.overlap = overlap
        self.compressor = compressor
        self.options = fam.canonical(options)
        self.process_group = process_group
        self.start_iter = ((2 if fam.stateful else 0) if start_iter is None
                           else _as_int(start_iter, "start_iter", 0))
        self.log_every = _as_int(log_every, "log_every", 0)
        self.iter = 0  # steps applied (a skipped or failed step does not count)
        self._calls = 0  # steps the hook saw, skipped ones included: the index of history
        self._owner = None  # the state that settles steps (hook("auto") for its candidates)
        # An object that changes each bucket before its plan reads it (see BucketTransform;
        # hook("onebit", adam=opt) sets 1-bit Adam's optimizer here); None: buckets go as they are
        self.bucket_transform: Optional[BucketTransform] = None
        self._agreed = False  # whether the ranks' first step agreed (see _agree_first_step)
        # [iteration, start_iter] as the ranks last agreed on them, advanced with every applied
        # step; None before the first check. A load into the running job does not move it: the
        # step after picks the plain allreduce or the compressed plan from it, so that a rank
        # that loaded alone issues what its peers issue (see _agree_first_step)
        self._job: Optional[list] = None
        self._steps = _Steps(self)
        self.stats = HookStats(compressor, TIMELINE_RUNS)  # history, last_stats, timeline
        # per-bucket plans, matched to parameters across DDP's bucket rebuild, and checkpoints
        self.table = BucketTable(COMPRESSORS[compressor].stateful, model)
        watch_capture(model)
        self._worker: Optional[Worker] = None
        self._closed = False  # close(): no worker is made again
        if live and not lazy:
            self._make_worker()

    def _make_worker(self, per_node: Optional[int] = None) -> Worker:
        """A process group of our own (same ranks and backend as the user's) and the thread
        that issues all of this hook's collectives in bucket order. Creating a group is itself
        collective, so it happens here, when every rank builds its hook, not inside backward.
        per_node: the node size of the groups for hierarchical plans (default: this hook's;
        hook("auto") shares one worker between flat and hierarchical candidates)."""
        per_node = self.per_node if per_node is None else per_node
        if self._closed:
            raise RuntimeError("gradcomp hook: this hook state was closed (close() ends its use "
                               "of the network); make a new hook to train on")
        if self._worker is None:
            pg = self.process_group
            # the user's timeout: torch's default (30 minutes) would let a hung peer hang us
            timeout = self.timeout or group_timeout(pg)
            if timeout is None:
                log.warning("gradcomp: this torch does not expose the process group's timeout; "
                            "the hook's collectives use torch's default (pass timeout= to "
                            "gradcomp.torch.hook)")
            kw = {} if timeout is None else {"timeout": timeout}
            own = dist.new_group(ranks=group_ranks(pg), backend=dist.get_backend(pg), **kw)
            if per_node:  # a hierarchical plan's node and cross groups beside it
                own = Topology(own, per_node, timeout)
            self._worker = Worker(own, pipeline=self.pipeline)
        return self._worker

    def close(self) -> None:
        """Ends this hook's use of the network, on every rank at the end of a job and before
        ``dist.destroy_process_group()``: waits for the collectives it has queued, stops its
        worker thread and releases the process groups it made (its own group, and a two-level
        plan's node and cross groups). A step after it raises RuntimeError; a second call does
        nothing. Without it the thread and the groups live until the interpreter exits, and a
        group released that late is destroyed while the interpreter shuts down, where a
        thread of gloo that still needs the interpreter ends the process (SIGABRT)."""
        self._closed = True
        w, self._worker = self._worker, None
        if w is not None:
            w.close(timeout=None)

    def set_model(self, model) -> None:
        """Gives a hook state the model its parameters are keyed by, as ``hook(model=...)``
        does: for a state restored by pickle (which keeps no model: the DDP model is the new
        process's), so that a checkpoint saved by a hook made with ``model=`` finds its
        parameters. Before the first step only (ValueError after)."""
        sd = dict(self.state_dict(), world_size=None)  # the buckets not applied yet: anew
        before = (self.table._param_index, self.table._param_shapes)
        self.table.set_model(model)
        try:
            checked = self._check_state_dict(sd)
        except Exception:  # nothing changes
            self.table._param_index, self.table._param_shapes = before
            raise
        self._apply_state_dict(checked)
        watch_capture(model)

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    # -- statistics (gradcomp/torch/_stats.py) ---------------------------------------------------
    @property
    def history(self) -> list:
        """The last 4096 steps the hook saw (skipped and failed ones included; each entry's
        "iter" numbers it): dense bytes, bytes handed to collectives, bytes on the wire, local
        and communication seconds, collectives, buckets, skipped buckets. Bounded, so a long job
        does not grow it; :attr:`totals` keeps the sums over every step."""
        return self.stats.history

    @property
    def totals(self) -> Dict[str, Any]:
        """The fields of :attr:`history` summed over every step since this state was made,
        and "steps", the number of steps."""
        return dict(self.stats.totals)

    @property
    def last_stats(self) -> Dict[int, Dict[str, Any]]:
        """Per bucket: the numbers of its last step."""
        return self.stats.last

    @property
    def timeline(self) -> "collections.deque":
        """The last plan runs (see gradcomp.torch.timeline())."""
        return self.stats.runs

    def _iteration(self, it: int) -> Dict[str, Any]:
        return self.stats.iteration(it)

    def _record(self, it: int, bucket_index: int, dense: int, stats: PlanStats,
                last: bool, skipped: bool = False) -> None:
        self.stats.record(it, bucket_index, dense, stats, last, self.log_every, skipped)

    @property
    def skipped_steps(self) -> int:
        """Steps in which some bucket was skipped because a rank's gradient held NaN or Inf
        (each such bucket came out NaN on every rank; the step left no state behind in any
        bucket, and ``iter`` did not advance)."""
        return self.stats.skipped_steps

    def _close_step(self, applied: bool, samples) -> None:
        """The end of a step (every bucket settled; see _Steps)."""
        self._calls += 1
        if applied:
            self.iter += 1
            if self._job is not None:
                self._job[0] += 1

    def _warmup(self, it: int) -> bool:
        """Whether this step runs the plain allreduce of the first start_iter iterations: from
        the iteration the ranks agreed on (the same on every rank), `it` before any check."""
        job = self._job
        return it < self.start_iter if job is None else job[0] < job[1]

    # -- buckets and checkpoints (gradcomp/torch/_buckets.py) -----------------------------------
    @property
    def buckets(self) -> Dict[int, "_Bucket"]:
        """The compressed buckets: plan, size, dtype, parameter layout, by DDP bucket index."""
        return self.table.buckets

    def _resolve(self, bucket):
        return self.table.resolve(bucket, lambda view, idx: COMPRESSORS[self.compressor].make(
            self.options, view, self.world, idx, self.process_group, self.per_node))

    def state_dict(self) -> Dict[str, Any]:
        """Per-rank state: options, iteration and each bucket's compressor state (bytes)."""
        return {"compressor": self.compressor, "options": dict(self.options),
                "start_iter": self.start_iter, "iter": self.iter,
                "world_size": self.world if dist.is_initialized() else None,
                "per_node": self.per_node, "buckets": self.table.state_dict()}

    def _check_state_dict(self, sd: Dict[str, Any]):
        """Everything load_state_dict() checks, nothing applied: (buckets, iter, start_iter)."""
        if not isinstance(sd, dict):
            raise ValueError(f"state_dict must be a dict, got {type(sd).__name__}")
        missing = [k for k in ("compressor", "iter", "start_iter", "buckets") if k not in sd]
        if missing:
            raise ValueError(f"state_dict lacks {missing}")
        if sd["compressor"] != self.compressor:
            raise ValueError(f"state is for compressor {sd['compressor']!r}, this hook is "
                             f"{self.compressor!r}")
        self._check_options(sd.get("options"))
        it = _as_int(sd["iter"], "state_dict['iter']", 0)
        start = _as_int(sd["start_iter"], "state_dict['start_iter']", 0)
        ws = sd.get("world_size")
        if ws is not None:
            ws = _as_int(ws, "state_dict['world_size']", 1)
            if dist.is_initialized() and ws != self.world:
                raise ValueError(f"state was saved with world size {ws}, the process group has "
                                 f"{self.world} (one rank's state_dict() loads on as many ranks; "
                                 f"gradcomp.torch.gather_state_dict() saves one that loads on "
                                 f"any number)")
        world = ws or (self.world if dist.is_initialized() else 1)
        saved_layout = _as_int(sd.get("per_node", 0), "state_dict['per_node']", 0)
        if saved_layout != self.per_node:
            def says(p):
                return f"nodes of {p} ranks (hierarchy='node')" if p else "a flat plan"
            raise ValueError(f"state was saved by {says(saved_layout)}, this hook runs "
                             f"{says(self.per_node)}: a hierarchical plan's state is each rank's "
                             f"shard, which moves with the layout")
        fam = COMPRESSORS[self.compressor]

        def check_state(k, e):  # a plan of that bucket's size loads the bytes, then is dropped
            if not fam.stateful:
                raise ValueError(f"state_dict bucket {k}: compressor {self.compressor!r} keeps "
                                 f"no bucket state")
            if not dist.is_initialized():  # (unpickled before init_process_group: this rank is
                return                     # not known yet; the bytes are checked when applied)
            flat = torch.empty(e["numel"], dtype=_TORCH_DTYPES[e["dtype"]])
            shapes = e["shapes"] if fam.uses_shapes else None
            plan = fam.make_flat(self.options, flat, world, k, self.process_group, shapes,
                                 self.per_node)
            try:
                plan.load_state_dict(e["state"])
            except ValueError as err:
                raise ValueError(f"state_dict bucket {k}: {err}") from None

        return self.table.check_state_dict(sd["buckets"], check_state), it, start

    #: options that change neither the state nor what a step computes (how a step checks its
    #: input and which exchange it picks for the link): a checkpoint loads across them
    _OPERATIONAL = frozenset(("check_finite", "on_nonfinite", "exchange", "latency_s",
                              "bandwidth_Bps"))

    def _check_options(self, saved) -> None:
        """A state belongs to the options it was made with (a residual of top-k at ratio 0.05
        is not one of ratio 0.1, a 2-bit error not a 4-bit one): a checkpoint whose options
        differ, defaults filled in on both sides, is refused naming each difference. (A state
        without options, from before they were saved, is not checked.)"""
        if saved is None:
            return
        if not isinstance(saved, dict):
            raise ValueError(f"state_dict['options'] must be a dict, got {type(saved).__name__}")
        fam = COMPRESSORS[self.compressor]
        mine, theirs = {**fam.defaults, **self.options}, {**fam.defaults, **fam.canonical(saved)}
        diff = [k for k in sorted(set(mine) | set(theirs), key=str)
                if k not in self._OPERATIONAL and mine.get(k) != theirs.get(k)]
        if diff:
            said = ", ".join(f"{k}={theirs.get(k)!r} (this hook: {mine.get(k)!r})" for k in diff)
            raise ValueError(f"state was saved by a {self.compressor!r} hook with {said}: a "
                             f"checkpoint loads into a hook with the same options")

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`. Everything is checked first (types, the compressor and
        its options, the world size, every bucket's state bytes with their checksum, sizes and
        finite values,
        the parameter layout against the model when one was given) and then either all of it is
        applied or, with a ValueError naming what is wrong, nothing. Bucket states are applied
        when DDP first hands their parameters to the hook (before or after its bucket rebuild).
        A gathered checkpoint (:func:`gather_state_dict`, every rank's state) loads on any world
        size: this rank's own state on as many ranks, a resharded one otherwise."""
        self._apply_state_dict(whole_or_none(
            is_gathered(sd), self.process_group,
            lambda: self._check_state_dict(local_state_dict(sd, self.process_group)[0])))

    def _apply_state_dict(self, checked) -> None:
        buckets, it, start = checked
        self.table.load_state_dict(buckets)
        self._steps.reset()
        self.iter = it
        self.start_iter = start

    def __getstate__(self):
        return {"compressor": self.compressor, "options": self.options,
                "log_every": self.log_every, "timeout": self.timeout,
                "pipeline": self.pipeline, "sd": self.state_dict(),
                "hierarchy": self.hierarchy, "overlap": self.overlap,
                "per_node": self.per_node or self._per_node_given}
    # (the process group and the worker thread are not pickled; a restored state makes its own)

    def __setstate__(self, d):
        layout = {} if d.get("hierarchy") is None else {"hierarchy": d["hierarchy"],
                                                         "per_node": d.get("per_node")}
        layout["overlap"] = d.get("overlap", True)
        self.__init__(d["compressor"], None, d["sd"]["start_iter"], d["log_every"], None,
                      d.get("timeout"), d.get("pipeline", True), _lazy=True, **layout,
                      **d["options"])
        self.load_state_dict(dict(d["sd"], world_size=None))


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sparse_error(bucket) -> Optional[ValueError]:
    """The error for a bucket holding a sparse gradient (``nn.Embedding(sparse=True)``): the
    plans compress flat dense buckets, and a sparse gradient has no such buffer."""
    buf = bucket.buffer()
    if buf.layout == torch.strided and not any(
            g is not None and g.layout != torch.strided for g in bucket.gradients()):
        return None
    return ValueError(
        "gradcomp hooks compress dense gradients, but this DDP bucket holds a sparse gradient "
        "(e.g. nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)); build those modules "
        "with sparse=False (their gradient is then dense and compressed like the others), or "
        "train them outside this DDP model")


class _Step:
    """One training step of a hook: its buckets settle in any order (the worker's, the native
    allreduce's callbacks, an error at once), and the last one to settle closes the step."""

    __slots__ = ("calls", "settled", "last_called", "bad", "kept", "unchecked", "samples",
                 "refusal")

    def __init__(self) -> None:
        self.calls = self.settled = 0
        self.last_called = self.bad = False
        self.kept: list = []  # plans whose step was kept (taken back if the step turns out bad)
        self.unchecked: list = []  # averaged buckets nothing checked (native allreduce)
        self.samples: list = []  # hook("auto")'s timing samples, filed when the step is applied
        self.refusal = None  # the bucket transform's agreed refusal: every bucket of the step fails


class _Steps:
    """Settles the steps of a hook state (`owner`: a GradcompState, or the AutoState whose
    candidates share it). A step in which any bucket was skipped (NaN/Inf on some rank: its
    average is NaN on every rank, so a GradScaler skips the optimizer step) or failed leaves no
    trace: the plans of the buckets that were kept take their step back (undo_step), the
    iteration does not advance, auto's timing samples of it are dropped. Every rank decides
    alike: skips agree across ranks by construction."""

    def __init__(self, owner) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._open: Optional[_Step] = None

    def join(self, last: bool) -> _Step:
        """A bucket of the current step was handed to the hook (main thread)."""
        with self._lock:
            if self._open is None:
                self._open = _Step()
            rec = self._open
            rec.calls += 1
            rec.last_called = rec.last_called or last
            return rec

    def settle(self, rec: _Step, bad: bool, kept=None, unchecked=None, sample=None) -> None:
        """A bucket of `rec` finished (any thread)."""
        with self._lock:
            rec.settled += 1
            rec.bad = rec.bad or bad
            if kept is not None:
                rec.kept.append(kept)
            if unchecked is not None:
                rec.unchecked.append(unchecked)
            if sample is not None:
                rec.samples.append(sample)
            if not (rec.last_called and rec.settled >= rec.calls):
                return
            # the step is over whatever happens below, so that a failure here cannot leave it
            # open (every later bucket would join it and the iteration would never advance)
            self._open = None
            try:
                if not rec.bad and rec.kept and rec.unchecked:
                    # only when there is state to protect: a native average nothing scanned
                    rec.bad = any(not _finite(b) for b in rec.unchecked)
                if rec.bad:
                    for p in rec.kept:
                        if p.can_undo:
                            p.undo_step()
                        else:  # check_finite=False keeps no copy of the state before the step
                            log.warning("gradcomp: a step was skipped or failed, but a bucket "
                                        "with check_finite=False cannot take its step back")
            finally:
                self.owner._close_step(not rec.bad, rec.samples)

    def reset(self) -> None:
        """Forgets a step left open (a restore between steps starts afresh)."""
        with self._lock:
            self._open = None


def _finite(b) -> bool:
    """Whether an averaged bucket holds no NaN/Inf: a CPU tensor, or (flag, event) computed on
    the stream that produced a CUDA average (waited for here, on any thread)."""
    if isinstance(b, tuple):
        flag, event = b
        event.synchronize()
        return bool(flag)
    return bool(torch.isfinite(b).all())


# Whether CUDA plans run on the worker's side stream (see _hook); False runs them on the
# submitting stream, as before the side stream existed, for measuring what it is worth
# (bench/gpu_overlap.py).
SIDE_STREAM = True


def _hook(state: "GradcompState", bucket, on_done=None) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if not buf.is_cuda:
        return _hook_on(state, bucket, buf, on_done)
    if _CAPTURING_FORWARD or torch.cuda.is_current_stream_capturing():
        # Refused before anything changes (no step joined, no counter moved): the error reaches
        # the user from loss.backward() once DDP has finished its part (see _fail_after_backward)
        return _fail_after_backward(GraphCaptureError(), buf)
    if not SIDE_STREAM:
        return _hook_on(state, bucket, buf, on_done)
    # Compression off the critical path: the bucket's plan (built, begun and run) goes on the
    # worker's own stream, which first waits for what the current stream (backward's) has queued
    # so far, i.e. this bucket's gradients; backward's later kernels do not wait for it. The
    # future records the side stream's completion, and DDP's wait on the future orders its
    # stream after it, as NCCL's work stream is ordered.
    side = (state._worker or state._make_worker()).side_stream(buf.device)
    side.wait_stream(torch.cuda.current_stream(buf.device))
    with torch.cuda.stream(side):
        return _hook_on(state, bucket, buf, on_done)


# Whether the model's last forward ran under CUDA graph capture. The hook itself cannot tell: DDP
# calls it from autograd's thread on the stream of the parameters' gradient accumulators, which
# autograd made in the first (uncaptured) steps, so that stream is not the capturing one, while
# the plan's host synchronisations would still invalidate the capture in progress (seen on an
# H200: cudaErrorStreamCaptureInvalidated instead of a message). A forward pre-hook on the model
# (gradcomp.torch.hook(..., model=...)) records it on the thread and stream that capture.
_CAPTURING_FORWARD = False


def _note_capture(_module, _inputs) -> None:
    global _CAPTURING_FORWARD
    _CAPTURING_FORWARD = torch.cuda.is_current_stream_capturing()


def watch_capture(model) -> None:
    """Registers _note_capture on the model once (any number of hook states may share it)."""
    if model is None or not torch.cuda.is_available():
        return
    if getattr(model, "_gradcomp_watches_capture", False):
        return
    model.register_forward_pre_hook(_note_capture)
    model._gradcomp_watches_capture = True


class GraphCaptureError(RuntimeError):
    """A gradcomp hook was called while its CUDA stream was being captured into a CUDA graph."""

    def __init__(self):
        super().__init__(
            "gradcomp hooks cannot be captured in a CUDA graph: each step's plan decides on the "
            "host (payload sizes and counts, the finiteness of every rank's gradient, retries of "
            "the sampled threshold, skipped steps) and runs its collectives from a worker thread, "
            "which a graph cannot replay. Capture the forward pass (or the model without DDP) "
            "and run backward with the hook outside the graph, or use DDP without a gradcomp "
            "hook inside the graph. Nothing of the hook's state changed.")


def _hook_on(state: "GradcompState", bucket, buf, on_done) -> torch.futures.Future[torch.Tensor]:
    """The hook for one bucket, on the stream its plan runs on (see _hook)."""
    idx = bucket.index()
    last = bucket.is_last()
    steps = (state._owner or state)._steps
    it = state.iter
    call = state._calls  # the history entry (iterations and skipped attempts alike)
    dense = buf.numel() * buf.element_size()
    state._iteration(call)
    rec = steps.join(last)
    settled = [False]  # each bucket settles its step once (failed() may follow a failed done())

    begin_s = [0.0, 0.0]
    # the plain allreduce before start_iter (stateful compressors): its average is scanned once
    # (only in those first iterations) so that an overflow there is skipped and counted too
    warmup = False
    plan = None

    def done(stats: PlanStats):
        stats.local_seconds += begin_s[1] - begin_s[0]  # begin() (e.g. PowerSGD's finite check)
        stats.events.insert(0, ("begin", begin_s[0], begin_s[1]))  # is local work
        settle(stats, None)

    def failed(error):  # e.g. on_nonfinite="raise" ending a skipped step: the step is bad
        settle(PlanStats(), error)

    def settle(stats: PlanStats, error):
        if settled[0]:
            return
        settled[0] = True
        if error is None and warmup:  # the plain allreduce checks nothing: a NaN is the signal
            skipped = not bool(torch.isfinite(buf).all())
        else:  # (begin() resets it, so it is never the previous step's)
            skipped = bool(getattr(plan, "skipped", False))
        state._record(call, idx, dense, stats, last, skipped)
        sample = None
        if on_done is not None and error is None:
            sample = on_done(idx, it, stats)
        # kept: a plan whose step may have to be taken back (a composite of restored buckets
        # may have kept some parts while another skipped or raised)
        keep = not warmup and plan is not None and bool(plan.stateful) and (
            (error is None and not skipped) or (isinstance(plan, _CompositePlan) and plan.can_undo))
        steps.settle(rec, skipped or error is not None, plan if keep else None, sample=sample)

    try:
        err = _sparse_error(bucket)
        if err is not None:
            raise err
        transform = state.bucket_transform
        if transform is not None:
            # (keys the bucket's parameters first: they are keyed at first sight, which a
            # refused first step must not skip, or a later restore would find other keys)
            state.table.layout(bucket)
        if state._owner is None:  # (hook("auto") checks for its candidates)
            _agree_first_step(state, buf, first_bucket=rec.calls == 1)
        warmup = state._warmup(it)
        if transform is not None:
            if rec.calls == 1:
                rec.refusal = _check_transform(state, transform, buf, it)
            if rec.refusal is not None:  # (the same verdict on every rank: no bucket is sent)
                raise rec.refusal
        if warmup:
            state.table.layout(bucket)  # parameters keyed in the order DDP first shows them
            fam = COMPRESSORS["allreduce"]
            view, permuted = bucket, False
            plan = fam.make({}, bucket, state.world, idx, state.process_group, state.per_node)
        else:
            fam = COMPRESSORS[state.compressor]
            if transform is not None:  # (1-bit Adam: the plan then averages m / d)
                transform.before_compress(bucket)
            view, b, permuted = state._resolve(bucket)
            plan = b.plan
            b.steps += 1
        begin_s[0] = time.perf_counter()
        fam.begin(plan, view)
        begin_s[1] = time.perf_counter()
    except Exception as e:
        # The step is bad (buckets already kept take their step back). Raised here, inside
        # DDP's backward, the error would stop DDP mid-step and leave the model unusable
        # ("unmarked_param_indices ... INTERNAL ASSERT"): the bucket keeps its own gradient and
        # loss.backward() raises the error once DDP has finished the step (see "Errors" in
        # _driver). Outside a backward pass it is raised at once.
        settled[0] = True
        steps.settle(rec, True)
        if last and state._worker is not None:  # buckets held for the end of backward go now
            state._worker.release()
        return _fail_after_backward(e, buf)

    def result():  # the plan averaged view in place
        if permuted:
            view.scatter()
        return buf

    worker = state._worker or state._make_worker()
    # inside DDP's backward an error must not fail the future (see "Errors" in _driver)
    return worker.submit(plan, result, done, buf.device, AfterBackward.arm(buf), failed,
                         hold=not (state.overlap or last))


def _fail_after_backward(error: Exception, buf) -> torch.futures.Future:
    """A hook's error inside DDP's backward: the bucket keeps its own gradient (a completed
    future) and loss.backward() raises `error` once DDP has finished the step, so that the model
    stays usable; outside a backward pass it is raised at once."""
    after = AfterBackward.arm(buf)
    if after is None:
        raise error
    after.error = error
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _check_transform(state, transform, buf, it: int) -> Optional[Exception]:
    """The bucket transform's check_step, once per step (at its first bucket), agreed: every
    rank's verdict travels in one allgather of a flag on the hook's group, so a refusal on one
    rank (an optimizer state loaded there alone) fails the step on every rank before any bucket
    is sent, instead of leaving the others waiting for its collectives. Returns what every bucket
    of the step raises (this rank's own error, or a ValueError naming the ranks that refused), or
    None. Any exception counts as a refusal: one that skipped the allgather would hang the peers.
    The flag goes as point-to-point pairs on gloo (one latency, not a ring's P - 1); on CUDA
    (NCCL) reading it back waits for the device once per step."""
    refusal = None
    try:
        transform.check_step(it)
    except Exception as e:  # noqa: BLE001 (raised below, after the peers learned of it)
        refusal = e
    if not (dist.is_available() and dist.is_initialized()):
        return refusal
    worker = state._worker or state._make_worker()
    if worker._failed is not None:  # (its group is unusable: the agreement would wait it out)
        return RuntimeError(f"gradcomp: an earlier collective of this hook failed, its process "
                            f"group is unusable: {worker._failed}")
    group = worker.group.world if isinstance(worker.group, Topology) else worker.group
    world = dist.get_world_size(group)
    mine = torch.tensor([0 if refusal is None else 1], dtype=torch.int64)
    pairs = _p2p_allgather(mine, group)
    if not pairs:
        mine = mine.to(buf.device)
    got = torch.empty(world, dtype=torch.int64, device=mine.device)
    if pairs:
        _all_gather_p2p(got, mine, world, group).wait()
    else:
        dist.all_gather(list(got.chunk(world)), mine, group=group)
    if refusal is not None:
        return refusal
    refused = [r for r, f in enumerate(got.tolist()) if f]
    if refused:
        return ValueError(f"gradcomp hook: the bucket transform of rank(s) {refused} refused "
                          f"step {it} (the error there says why); no rank ran the step")
    return None


def _agree_first_step(state, buf, first_bucket: bool = True) -> None:
    """The first step a hook state runs (in this process) starts with one small allgather of
    (iteration, start_iter, a digest of the compressor and its options) on the hook's own group;
    a ValueError on every rank when they differ. A rank restored alone (iteration 5 where its
    peers start at 0), or built with other options, would otherwise issue other collectives
    than its peers from the first bucket on (a plain allreduce against a compressed exchange),
    which gloo answers with an abort or a hang. After a failed check the next step checks again.

    A state loaded into the running job on one rank moves that rank's iteration, maybe across
    start_iter, and its peers cannot know: every rank must keep issuing the same collectives.
    So the phase of a step (plain allreduce or compressed) follows the iteration the ranks last
    agreed on (state._job), not a loaded one, and the check runs at every step while that
    iteration is at most start_iter (the plain steps and the first compressed one: start_iter + 1
    small collectives per job), where a loaded iteration is told on every rank. Past it the
    ranks compress, and the plans' own checks (their headers and consensus slots carry each
    rank's step) tell a rank whose state is another step's: a state from before compression
    began leaves the rank's live plans at step 0 (see BucketTable.resolve). Once agreed, the
    check runs at a step's first bucket only: later buckets' plans may be on the wire already,
    on the same group, from the worker thread."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    job = getattr(state, "_job", None)  # (hook("auto") keeps none: its first step only)
    if state._agreed and (job is None or job[0] > job[1] or not first_bucket):
        return
    worker = state._worker or state._make_worker()
    group = worker.group.world if isinstance(worker.group, Topology) else worker.group
    # (a bucket transform on some ranks only would have them alone agree on its verdicts)
    digest = zlib.crc32(repr((state.compressor, sorted(state.options.items(), key=str),
                              getattr(state, "per_node", 0),
                              getattr(state, "bucket_transform", None) is not None)).encode())
    mine = torch.tensor([state.iter, state.start_iter, digest], dtype=torch.int64,
                        device=buf.device)
    world = dist.get_world_size(group)
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    rows = [g.tolist() for g in got]
    state._agreed = False  # (until every row matches: the next step checks again)
    for r, row in enumerate(rows):
        if row[0] != rows[0][0]:
            raise ValueError(f"gradcomp hook: the ranks start at different iterations (rank 0 at "
                             f"{rows[0][0]}, rank {r} at {row[0]}): restore every rank's state, "
                             f"or none; no rank ran the step")
        if row[1:] != rows[0][1:]:
            raise ValueError(f"gradcomp hook: rank {r}'s compressor, options or start_iter "
                             f"differ from rank 0's: build the hook alike on every rank; no rank "
                             f"ran the step")
    state._agreed = True
    if hasattr(state, "_job"):
        state._job = [state.iter, state.start_iter]


def _layout(hierarchy, per_node, group) -> int:
    """Ranks per node for hierarchy="node" (0: flat). per_node: given, or torchrun's
    LOCAL_WORLD_SIZE. `group`: the live process group (False before init_process_group: the
    checks against the world size wait for the first use). With a live group the ranks agree
    first, in one all_gather_object over it: a bad or differing layout on any rank (another
    LOCAL_WORLD_SIZE on one node, a LOCAL_RANK that is not rank % per_node) raises the same
    ValueError on every rank, before any process group of the layout is made (a rank that raised
    alone would leave the others waiting in new_group)."""
    if hierarchy in (None, "flat"):
        if per_node is not None:
            raise ValueError("per_node is the node size of hierarchy='node'; pass both (or "
                             "neither, for a flat plan)")
        return 0
    if hierarchy != "node":
        raise ValueError(f"hierarchy must be 'node' (full precision inside a node, compressed "
                         f"across nodes) or None, got {hierarchy!r}")
    value, err = None, None
    try:
        value = _local_per_node(per_node)
    except ValueError as e:
        err = str(e)
    if group is False:
        if err is not None:
            raise ValueError(err)
        return value
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = os.environ.get("LOCAL_RANK")
    if err is None and local is not None and group is None and \
            (not local.strip().isdigit() or int(local) != rank % value):
        err = (f"LOCAL_RANK={local}, but a hierarchical plan numbers ranks node-major (local rank "
               f"= rank % per_node = {rank % value}); launch with torchrun, or pass per_node "
               f"matching the launcher's layout")
    every = [None] * world
    dist.all_gather_object(every, (value, err), group=group)
    bad = [(r, e) for r, (_, e) in enumerate(every) if e is not None]
    if bad:
        raise ValueError(f"hierarchy='node' on rank {bad[0][0]}: {bad[0][1]}"
                         + (f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""))
    values = [v for v, _ in every]
    if len(set(values)) != 1:
        raise ValueError(f"the ranks disagree on per_node (by rank: {values}); every rank must "
                         f"pass the same node size")
    if world % value:
        raise ValueError(f"per_node={value} does not divide the world size {world}")
    return value


def _local_per_node(per_node) -> int:
    """per_node as given, or torchrun's LOCAL_WORLD_SIZE (this rank's view; _layout makes the
    ranks agree)."""
    if per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("hierarchy='node' needs per_node= (ranks per node), or torchrun's "
                             "LOCAL_WORLD_SIZE in the environment")
        if not env.strip().isdigit():
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a number of ranks")
        per_node = int(env)
    return _as_int(per_node, "per_node", 1)


def _as_timeout(t) -> Optional[datetime.timedelta]:
    if t is None:
        return None
    if isinstance(t, datetime.timedelta):
        seconds = t.total_seconds()
    elif isinstance(t, (int, float)) and not isinstance(t, bool):
        seconds = float(t)
    else:
        raise ValueError(f"timeout must be a datetime.timedelta or a number of seconds, got {t!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout must be positive and finite, got {t!r}")
    try:
        return datetime.timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"timeout must be at most {datetime.timedelta.max.total_seconds():.0f} "
                         f"seconds, got {t!r}") from None


def dgc_optimizer(params, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.SGD:
    """SGD without momentum, for hooks that apply momentum themselves: ``topk`` and
    ``randomk`` with ``momentum=m`` (DGC's momentum correction) and ``onebit`` with
    ``momentum=m`` (each rank compresses its momentum). The hook already accumulates momentum
    before compression; applying it again in the optimizer would square it."""
    if kwargs.get("momentum", 0.0):
        raise ValueError("with DGC momentum correction the optimizer must not apply momentum; "
                         "set momentum on the hook instead")
    return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay, **kwargs)
