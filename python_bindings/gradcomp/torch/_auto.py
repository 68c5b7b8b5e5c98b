# SPDX-License-Identifier: Apache-2.0
"""The automatic mode of the DDP hook: ``gradcomp.torch.hook("auto", ...)``.

It measures instead of guessing. After ``start_iter`` plain steps (DDP rebuilds its buckets in
the first iteration), a *trial* runs every candidate for ``trial_steps`` iterations on every
bucket, on the real model, process group and link. Each bucket's cost in a step is what the hook
itself spent on it: local compression work plus launching and waiting for its collectives
(``local_seconds + comm_seconds`` of the plan run; the first step of each candidate, which builds
its plans, is not counted). The ranks' samples are gathered (one small allreduce on the hook's
own process group, so every rank decides the same); a candidate's cost is, per measured step,
the least over the ranks (the rank that started last, which waits for no one: the others' times
include their wait for it), then the median over the steps (3 measured by default: a step that a
busy machine slowed, which only ever adds time, then moves nothing, where the median of 2 is
their mean); and each bucket gets the cheapest
candidate, except that a more faithful candidate wins when it costs at most ``1 + margin`` times
the cheapest, or when the cheapest would save less than ``step_margin`` of the step (the
bucket's share, by its elements, of the step the fastest candidate ran in the trial: per
candidate the mean over ranks of each rank's median measured step, then the least; see
_step_scale) (faithfulness: allreduce, bf16,
fp16, fp8, quant, powersgd, topk). The second rule is there because what a bucket's cost leaves
out is paid by the step: compression's own passes over memory and its worker thread take CPU and
memory bandwidth from backward, which the hook's timings do not see. Where the link is fast, two
candidates cost about the same per bucket, and a saving below a few percent of the step is within
the noise of a trial of a few steps: the rule keeps the more faithful candidate there, at a cost
of at most that saving (on 36 settings it changed 9 choices and no speed beyond the runs' noise:
experiments/results/auto_ab_2026-12-01). Every ``recheck_every``
iterations the trial runs again (0: never). The ``allreduce`` candidate (and the plain steps
before ``start_iter``) is DDP's own average, bit for bit (each gradient multiplied by 1/P, as
DDP's reducer does without a hook, then torch.distributed's allreduce on the user's process
group), issued by the hook at once, so that on a fast link auto costs what any comm hook costs
over plain DDP (one pass over the bucket for the 1/P); its cost is measured from launch to
completion.

On gloo with more than 2 ranks fp16, bf16, fp8 and quant are also tried by their ``gather``
route, as ``"fp16/gather"`` or ``"quant/gather"`` (see GATHER), and fp16 by its ``allreduce``
route, as ``"fp16/allreduce"`` (gloo's ring, PyTorch's fp16 hook's collective; see RING). With ``hierarchy="node"`` (and
``per_node``, or torchrun's ``LOCAL_WORLD_SIZE``) every candidate is also tried as a two-level plan (full precision inside a node, the candidate across nodes), as
``"<name>@node"``; the flat form comes first, so it is kept when the two cost the same.

The accuracy budget is the candidate list and three bounds: ``min_rank`` (PowerSGD's rank),
``min_bits`` (the multi-bit candidate's bits per value, 2, 4 or 8) and ``max_density`` (top-k's
fraction of elements sent). Top-k is not a default candidate: it needs
DGC momentum correction (``dgc_optimizer``) to match plain SGD with momentum. When a bucket's
choice changes, the state of the compressor it leaves (PowerSGD's error and Q, top-k's residual)
is dropped, so a later return starts clean; the residual a stateful candidate held at the end of
its trial is likewise dropped unless it was chosen.
"""
import logging
import math
import statistics
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp import _C

from ._buckets import _as_int
from ._driver import PlanStats, _gloo, wire_bytes
from ._families import _device_of, _stream_of
from ._hook import GradcompState, _agree_first_step, _fail_after_backward, _hook, _layout, _Steps
from ._reshard import is_gathered, local_state_dict, whole_or_none

log = logging.getLogger("gradcomp")

#: Candidates from the most to the least faithful to the plain average.
FIDELITY = ("allreduce", "bf16", "fp16", "fp8", "quant", "powersgd", "topk")
#: quant (min_bits bits per value) is one of them because on links both slow and far (100 Mbit/s
#: with 50 ms round trips, the sweep of experiments/auto_sweep.py) it was the fastest of the
#: faithful families: an eighth of fp32's bytes in two message rounds, where PowerSGD's two
#: allreduces pay the latency 2(P-1) times each and fp16 sends half the bytes.
DEFAULT_CANDIDATES = ("allreduce", "fp16", "quant", "powersgd")
#: With hierarchy="node", each candidate also runs as a two-level plan under this suffix
#: ("powersgd@node": PowerSGD across nodes, full precision inside them).
HIER = "@node"
#: On gloo with more than 2 ranks the fp16, bf16 and fp8 plans' reduce-scatter route takes two
#: message rounds (an all-to-all, then the allgather) and their gather route one (an allgather of
#: the whole wire buffer: P/2 times the bytes received). Which is cheaper depends on the link's
#: latency against its rate, so both are measured: the gather route as a candidate of its own
#: under this suffix ("fp16/gather"), which the flat name precedes and is kept on a tie. For fp16
#: and bf16 it is bitwise the same average; fp8's reduce-scatter route rounds the summed chunks
#: to fp8 a second time, its gather route does not (both stateless, so a checkpoint's choice of
#: either loads as the other where only one exists). (On 2 ranks the plans take the gather
#: route themselves.) So does quant: its two phases (an all-to-all of the codes, each rank's
#: chunk averaged and quantized again, an allgather) against its gather route (one allgather of
#: every rank's codes, each rank averaging all of them: no second quantization). Its state (the
#: worker error) is the same kind by either route: a checkpoint lends either route's state to
#: the other (see _check_auto).
GATHER = "/gather"
_ROUTED = ("fp16", "bf16", "fp8", "quant")
#: fp16's allreduce route on gloo with more than 2 ranks: gloo's own ring allreduce of the fp16
#: buffer (what PyTorch's fp16_compress_hook issues), 2 (P - 1) message rounds where the
#: reduce-scatter route takes two, but its segments are pipelined round the ring: where latency
#: is small, it moved the same bytes 8-10% sooner than the two phases (the CNN on 4 ranks with 1
#: Gbit/s links, 89 against 96 ms a step; the MLP, 280 against 305-322 ms), which left auto below
#: PyTorch's fp16 hook on fast, near links. Measured as a candidate of its own under this suffix,
#: after the gather route (both are kept on a tie). Its sum is in fp16, in ring order (the same
#: bits on every rank); the other routes sum in fp32 in rank order. bf16 has no such route worth
#: trying: gloo does not sum bf16 (the driver widens it to fp32, twice the bytes). Stateless, so
#: a checkpoint's choice of it loads as fp16 where the candidate does not exist.
RING = "/allreduce"
_RING_ROUTED = ("fp16",)
#: every route suffix, and the route option it stands for
_ROUTES = {GATHER: "gather", RING: "allreduce"}


def _route_suffix(name: str) -> str:
    """The route suffix of a (flat, not two-level) candidate name, "" for its default route."""
    return next((sfx for sfx in _ROUTES if name.endswith(sfx)), "")


def _flat(name: str) -> str:
    """A candidate's name without its route suffix ("fp16/gather" -> "fp16")."""
    sfx = _route_suffix(name)
    return name[:-len(sfx)] if sfx else name


def _family(name: str) -> Tuple[str, Dict[str, Any], bool]:
    """(family, extra options, two-level) of a candidate name."""
    hier = name.endswith(HIER)
    fam = name[:-len(HIER)] if hier else name
    sfx = _route_suffix(fam)
    if sfx:
        return fam[:-len(sfx)], {"route": _ROUTES[sfx]}, hier
    return fam, {}, hier


def _routes(c: str) -> Tuple[str, ...]:
    """Candidate c and its route candidates (on gloo with more than 2 ranks; see GATHER, RING)."""
    return (c, *((c + GATHER,) if c in _ROUTED else ()),
            *((c + RING,) if c in _RING_ROUTED else ()))


def _gathers(group) -> bool:
    """Whether the gather route is worth its own candidate on this live group (see GATHER)."""
    return _gloo(group) and dist.get_world_size(group) > 2


def choose(costs: Dict[int, Dict[str, float]], candidates: Sequence[str],
           margin: float = 0.05, step_margin: float = 0.0, step_s: Optional[float] = None,
           shares: Optional[Dict[int, float]] = None) -> Dict[int, str]:
    """Per bucket, the candidate to run from measured costs (seconds per step; candidates in
    ``candidates`` order, the most faithful first): the first one that costs at most
    ``(1 + margin)`` times the cheapest, or at most the cheapest plus ``step_margin`` of the
    bucket's share of the step (``step_s`` seconds, ``shares[idx]`` the bucket's fraction of the
    model's elements; without them only the first rule). A candidate without a cost is not
    eligible.

    Example::

        >>> choose({0: {"allreduce": 0.30, "fp16": 0.18, "powersgd": 0.08},
        ...         1: {"allreduce": 0.010, "fp16": 0.0102, "powersgd": 0.012}},
        ...        ["allreduce", "fp16", "powersgd"])
        {0: 'powersgd', 1: 'allreduce'}
    """
    out = {}
    for idx in sorted(costs):
        per = {c: v for c, v in costs[idx].items() if v is not None and math.isfinite(v)}
        if not per:
            raise ValueError(f"bucket {idx}: no candidate has a measured cost")
        best = min(per.values())
        slack = best * margin
        if step_s is not None and shares is not None:
            slack = max(slack, step_margin * step_s * shares.get(idx, 0.0))
        out[idx] = next(c for c in candidates if c in per and per[c] <= best + slack)
    return out


def _skew_free_cost(samples: torch.Tensor) -> Optional[float]:
    """A candidate's cost for one bucket from every rank's samples (rows: ranks, columns: the
    trial's measured steps, -1 where none): per step the least over the ranks, then the median
    over the steps. A rank's time in a bucket's plan runs from its own start to the collectives'
    end, which every rank reaches together, so the ranks that finished backward earlier also
    count their wait for the last one; the last to start waits for nobody, and its time is what
    the candidate adds to the step. On 4 ranks sharing 2 cores that wait (12-80 ms per rank for
    a 4.8 MB bucket that takes a few ms to move) was what set the mean of the ranks' times, and
    with it the choice (experiments/results/auto_skew_ab_2026-12-02)."""
    mins = [float(col[col >= 0].min()) for col in samples.t() if bool((col >= 0).any())]
    return statistics.median(mins) if mins else None


def _mean_cost(samples: torch.Tensor) -> Optional[float]:
    """The earlier rule (an A/B variant): each rank's median over its samples, averaged over the
    ranks that have any (the earlier rule exactly where every rank has samples, as in every
    trial run to its end; it averaged a rank's "none" marker in)."""
    meds = [statistics.median([float(x) for x in row if x >= 0]) for row in samples
            if bool((row >= 0).any())]
    return sum(meds) / len(meds) if meds else None


def _candidate_steps(per_candidate: torch.Tensor,
                     names: Optional[Sequence[str]] = None) -> Dict[Any, float]:
    """Each candidate's step time from every rank's medians (one column per candidate, -1 where
    none): the mean over the ranks that have it, keyed by ``names`` (or the column index); a
    candidate no rank measured is left out."""
    keys = list(names) if names is not None else list(range(per_candidate.shape[1]))
    return {k: float(col[col > 0].mean()) for k, col in zip(keys, per_candidate.t())
            if bool((col > 0).any())}


def _step_scale(per_candidate: torch.Tensor, whole: torch.Tensor,
                fastest: bool = True) -> Optional[float]:
    """The step time that ``step_margin`` is a share of, from every rank's median step times
    (seconds, -1 where none): ``per_candidate`` one column per candidate (the steps it ran in
    the trial), ``whole`` one entry per rank (every measured step of the trial). The step the
    choice will run is about as fast as the fastest candidate's, so that is the scale: per
    candidate the mean over the ranks that have its steps, then the least over the candidates.
    The whole trial's step (``fastest=False``, the rule before it: the mean over the ranks of
    each rank's median over every measured step) counts the slow candidates' steps in: where
    plain DDP's and fp16's steps took 2-4x the compressed ones (the ViT on 4 ranks at 100
    Mbit/s: a 438 ms median against 236-326 ms with quant or PowerSGD), 5% of it (22 ms) let
    quant's 71 ms stand against PowerSGD's 51 ms, and the timed steps ran 263 ms where
    PowerSGD's ran 208 (experiments/results/auto_sweep_2026-12-02). A candidate none of whose
    steps was measured does not count; with no step measured at all, the scale is unknown
    (None: only the bucket rule decides)."""
    if fastest:
        means = _candidate_steps(per_candidate)
        if means:
            return min(means.values())
    steps = whole[whole > 0]
    return float(steps.mean()) if steps.numel() else None


def _check_int(name: str, v: Any, low: int) -> int:
    return _as_int(v, name, low)  # (the one integer check of the hooks)


class AutoState:
    """State of ``hook("auto")``: one sub-state per candidate (sharing one worker thread and
    process group), the trial schedule, the measurements and the per-bucket choices.

    ``choices`` maps DDP bucket index -> candidate name once a trial has ended; ``trials`` lists
    each decision (iteration, consensus cost per bucket and candidate in seconds, choices).
    """

    compressor = "auto"

    def __init__(self, process_group=None, start_iter: Optional[int] = None, log_every: int = 0,
                 model=None, timeout=None, candidates: Iterable[str] = DEFAULT_CANDIDATES,
                 min_rank: int = 4, max_density: float = 0.01, trial_steps: int = 4,
                 min_bits: int = 4,
                 recheck_every: int = 1000, margin: float = 0.05, step_margin: float = 0.05,
                 pipeline: bool = True,
                 hierarchy: Optional[str] = None, per_node: Optional[int] = None,
                 _lazy: bool = False, _gather: Optional[bool] = None):

        if isinstance(candidates, str):
            raise ValueError("candidates must be a sequence of compressor names, not a string")
        cands = list(candidates)
        unknown = [c for c in cands if c not in FIDELITY]
        if unknown or not cands or len(set(cands)) != len(cands):
            raise ValueError(f"candidates must be distinct names among {list(FIDELITY)}, got "
                             f"{cands!r}")
        self.candidates = [c for c in FIDELITY if c in cands]
        live = dist.is_available() and dist.is_initialized()
        self.per_node = _layout(hierarchy, per_node, process_group if live else False)
        if self.per_node:  # each candidate also as a two-level plan (flat first: kept on a tie)
            self.candidates = [n for c in self.candidates for n in (c, c + HIER)]
        # (_gather: what a pickled state measured, where the group is not known yet)
        self._gather = bool(_gather) if _gather is not None else \
            bool(live and not self.per_node and _gathers(process_group))
        if self._gather:
            self.candidates = [n for c in self.candidates for n in _routes(c)]
        _check_int("min_rank", min_rank, 1)
        if _check_int("min_bits", min_bits, 2) not in (2, 4, 8):
            raise ValueError(f"min_bits must be 2, 4 or 8, got {min_bits!r}")
        if isinstance(max_density, bool) or not isinstance(max_density, (int, float)) \
                or not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density!r}")
        self.trial_steps = _check_int("trial_steps", trial_steps, 2)  # a warm-up + a measured one
        self.recheck_every = _check_int("recheck_every", recheck_every, 0)
        trial_len = len(self.candidates) * self.trial_steps
        if 0 < self.recheck_every <= trial_len:
            raise ValueError(f"recheck_every ({recheck_every}) must be 0 or longer than a trial "
                             f"({len(self.candidates)} candidates x {trial_steps} steps)")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) \
                or not (margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        if isinstance(step_margin, bool) or not isinstance(step_margin, (int, float)) \
                or not 0 <= step_margin < 1:
            raise ValueError(f"step_margin must be a number in [0, 1), got {step_margin!r}")
        self.options = dict(candidates=[c for c in self.candidates if c in FIDELITY],
                            min_rank=min_rank, max_density=max_density, min_bits=min_bits,
                            trial_steps=trial_steps, recheck_every=recheck_every, margin=margin,
                            step_margin=step_margin)
        if self.per_node:
            self.options.update(hierarchy=hierarchy, per_node=per_node)
        self.start_iter = 2 if start_iter is None else _check_int("start_iter", start_iter, 0)
        self.margin = float(margin)
        self.step_margin = float(step_margin)
        self.pipeline = pipeline
        self.log_every = _check_int("log_every", log_every, 0)
        self.timeout = timeout
        per = {"allreduce": {}, "bf16": {}, "fp16": {}, "fp8": {}, "quant": {"bits": min_bits},
               "powersgd": {"rank": min_rank},
               "topk": {"ratio": max_density}}
        names = self.candidates if "allreduce" in self.candidates else \
            ["allreduce"] + self.candidates  # plain steps before start_iter
        def sub(n: str) -> GradcompState:
            fam, extra, hier = _family(n)
            where = dict(hierarchy="node", per_node=self.per_node) if hier else {}
            return GradcompState(fam, process_group, 0, 0, model, timeout, pipeline, _lazy=True,
                                 **where, **per[fam], **extra)

        self.subs: Dict[str, Any] = {n: sub(n) for n in names}
        self.process_group = process_group
        self.compressor = "auto"
        self._agreed = False  # whether the ranks' first step agreed (see _agree_first_step)
        self.iter = 0  # steps applied (a skipped or failed step does not count)
        self._calls = 0  # steps the hook saw: the index of every candidate's history
        self._steps = _Steps(self)  # steps settle across candidates (see _Steps)
        for sub in self.subs.values():
            sub._owner = self
        self.choices: Dict[int, str] = {}
        self.trials: List[Dict[str, Any]] = []
        self._trial_start = self.start_iter
        self._decided_trial: Optional[int] = None
        self._decided_at: Optional[int] = None
        self._seen: Optional[int] = None
        self._samples: Dict[Tuple[int, str], List[float]] = {}
        # the trial's step times (from one iteration's first bucket to the next one's) by the
        # candidate that ran the step, and each bucket's elements: the scale of step_margin
        self._step_seconds: Dict[str, List[float]] = {}
        self._last_mark: Optional[Tuple[int, float]] = None
        self._numel: Dict[int, int] = {}
        # the cost of a candidate across ranks: per step the least (see _skew_free_cost); False:
        # the mean of the ranks' medians, the rule before it (for the A/B, not an option)
        self._skew_free = True
        # step_margin's step: the fastest candidate's (see _step_scale); False: the mean over
        # the whole trial, the rule before it (for the A/B, not an option)
        self._fastest_step = True
        self._worker = None
        if dist.is_available() and dist.is_initialized() and not _lazy:
            self._make_worker()

    # -- the worker: one thread and process group for every candidate ------------------------------
    def _make_worker(self):
        if self._worker is None:
            self._worker = self.subs["allreduce"]._make_worker(per_node=self.per_node)
            for s in self.subs.values():
                s._worker = self._worker
        return self._worker

    def close(self) -> None:
        """As GradcompState.close: every rank, at the end of a job, before
        ``dist.destroy_process_group()``; stops the worker its candidates share and releases
        its process groups. A step after it raises RuntimeError."""
        w, self._worker = self._worker, None
        for sub in self.subs.values():
            sub._worker = None
            sub.close()
        if w is not None:
            w.close(timeout=None)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    # -- schedule --------------------------------------------------------------------------------
    def _trial_len(self) -> int:
        return len(self.candidates) * self.trial_steps

    def phase(self, it: int) -> Tuple[str, Optional[str], bool]:
        """(phase, candidate for every bucket or None, measured) of iteration `it`: "plain"
        before start_iter, "trial" while candidates take turns, "chosen" after a decision."""
        if it < self.start_iter:
            return "plain", "allreduce", False
        k = it - self._trial_start
        if 0 <= k < self._trial_len():
            return "trial", self.candidates[k // self.trial_steps], k % self.trial_steps != 0
        return "chosen", None, False

    def _new_step(self, it: int, like: Optional[torch.Tensor] = None) -> None:
        """Runs once per iteration, at its first bucket (the same point on every rank); `like`
        is that bucket, whose device the consensus runs on."""
        if it < self.start_iter:
            return
        now = time.perf_counter()
        if self._decided_trial != self._trial_start:  # in a trial, or just after one
            # a step counts when it was a measured one (not a candidate's first, which builds
            # its plans) and the one right before this (a skipped step does not advance `it`)
            if self._last_mark is not None and self._last_mark[0] == it - 1 \
                    and self.phase(it - 1)[2]:
                self._step_seconds.setdefault(self.phase(it - 1)[1], []).append(
                    now - self._last_mark[1])
            self._last_mark = (it, now)
            if it >= self._trial_start + self._trial_len():
                self._decide(it, like)
        elif self.recheck_every and it >= self._decided_at + self.recheck_every:
            self._trial_start = it  # a new trial starts with this iteration
            self._clear_trial((it, now))

    def _clear_trial(self, mark: Optional[Tuple[int, float]] = None) -> None:
        """Forgets a trial's measurements: the costs and the step times (`mark`: the iteration
        and time a new trial's first step starts at)."""
        self._samples = {}
        self._step_seconds = {}
        self._last_mark = mark

    def _decide(self, it: int, like: Optional[torch.Tensor] = None) -> None:
        buckets = sorted({idx for idx, _ in self._samples})
        cands = self.candidates
        # every rank's samples (-1: none), step by step, then its median step time under each
        # candidate (-1: none, a trial resumed at its end, or a candidate whose measured steps
        # were skipped); a candidate has at most trial_steps - 1 measured steps
        k, n = self.trial_steps, len(cands)
        base_steps = len(buckets) * n * k
        local = torch.full((base_steps + n + 1,), -1.0, dtype=torch.float32)
        for i, idx in enumerate(buckets):
            for j, c in enumerate(cands):
                v = (self._samples.get((idx, c)) or [])[-k:]
                base = (i * n + j) * k
                local[base:base + len(v)] = torch.tensor(v, dtype=torch.float32)
        for j, c in enumerate(cands):
            if self._step_seconds.get(c):
                local[base_steps + j] = statistics.median(self._step_seconds[c])
        every_step = [x for c in cands for x in self._step_seconds.get(c, [])]
        if every_step:
            local[-1] = statistics.median(every_step)
        every = self._gather_ranks(local, like)  # one row per rank, the same on every rank
        rule = _skew_free_cost if self._skew_free else _mean_cost
        costs = {idx: {c: rule(every[:, (i * n + j) * k:(i * n + j + 1) * k])
                       for j, c in enumerate(cands)}
                 for i, idx in enumerate(buckets)}
        # the same on every rank: the step time and the buckets' sizes (DDP's, alike)
        step_s = _step_scale(every[:, base_steps:base_steps + n], every[:, -1],
                             self._fastest_step)
        total = sum(self._numel.get(idx, 0) for idx in buckets)
        shares = {idx: self._numel.get(idx, 0) / total for idx in buckets} if total else None
        self.choices = choose(costs, cands, self.margin, self.step_margin, step_s,
                              shares) if buckets else {}
        per_step = _candidate_steps(every[:, base_steps:base_steps + n], cands)
        self.trials.append({"iter": it, "costs": costs, "choices": dict(self.choices),
                            "step_seconds": step_s, "candidate_step_seconds": per_step})
        self._decided_trial = self._trial_start
        self._decided_at = it
        self._clear_trial()
        # the state of a compressor a bucket does not run is dropped: a later return starts clean
        for name, sub in self.subs.items():
            for idx in list(sub.buckets):
                if self.choices.get(idx) != name:
                    del sub.buckets[idx]
        log.info("gradcomp auto at iteration %d: %s", it,
                 ", ".join(f"bucket {i}: {c}" for i, c in sorted(self.choices.items())))

    def _gather_ranks(self, local: torch.Tensor,
                      like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every rank's measurements, one row per rank in rank order (the same matrix on every
        rank), through the hook's own worker (so it is ordered with the hook's collectives on
        every rank), on the device of `like` (the step's first bucket): the group may be NCCL's,
        which takes no CPU tensors. Each rank writes its row into zeros and one averaging
        allreduce sums them (a sum with zeros is exact); the mean is scaled back by P."""
        if local.numel() == 0 or not (dist.is_available() and dist.is_initialized()):
            return local.reshape(1, -1)
        world, me = self.world, dist.get_rank(self.process_group)
        rows = torch.zeros(world, local.numel(), dtype=torch.float32)
        rows[me] = local
        t = rows.reshape(-1) if like is None else rows.reshape(-1).to(like.device)
        dev, index = _device_of(t)
        stream = _stream_of(t)
        plan = _C.make_plan("allreduce", t.numel(), "float32", world, device=dev,
                            device_index=index, stream=stream)
        plan.begin(t, stream)
        worker = self._worker or self._make_worker()
        mean = worker.submit(plan, lambda: t, device=t.device).wait().cpu()
        return (mean * world).reshape(world, -1)

    def _sampler(self, name: str):
        def on_done(idx: int, it: int, stats):  # filed by _close_step if the step is applied
            return (idx, name), stats.local_seconds + stats.comm_seconds
        return on_done

    def _close_step(self, applied: bool, samples) -> None:
        """The end of a step (every bucket settled): a skipped or failed step neither advances
        the schedule nor leaves timing samples (see gradcomp.torch._Steps)."""
        self._calls += 1
        if applied:
            self.iter += 1
            for key, seconds in samples:
                self._samples.setdefault(key, []).append(seconds)

    # -- statistics ------------------------------------------------------------------------------
    @property
    def history(self) -> List[Dict[str, Any]]:
        """Per step, the sum over candidates of their statistics, for the steps the candidates
        still keep (see GradcompState.history)."""
        merged: Dict[int, Dict[str, Any]] = {}
        for sub in self.subs.values():
            for h in sub.history:
                acc = merged.setdefault(h["iter"], {"iter": h["iter"]})
                for k, v in h.items():
                    if k != "iter":
                        acc[k] = acc.get(k, 0) + v
        return [merged[k] for k in sorted(merged) if k < self._calls]

    @property
    def totals(self) -> Dict[str, Any]:
        """The statistics summed over every step and candidate (see GradcompState.totals)."""
        out: Dict[str, Any] = {}
        for sub in self.subs.values():
            for k, v in sub.totals.items():
                if k != "steps":
                    out[k] = out.get(k, 0) + v
        out["steps"] = self._calls
        return out

    @property
    def last_stats(self) -> Dict[int, Dict[str, Any]]:
        """Each bucket's statistics from the candidate it ran last."""
        merged: Dict[int, Dict[str, Any]] = {}
        for name, sub in self.subs.items():
            for idx, s in sub.last_stats.items():
                if idx not in merged or s["iter"] > merged[idx]["iter"]:
                    merged[idx] = dict(s, compressor=name)
        return merged

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"compressor": "auto", "options": dict(self.options), "start_iter": self.start_iter,
                "iter": self.iter, "choices": dict(self.choices), "trials": list(self.trials),
                "trial_start": self._trial_start, "decided_trial": self._decided_trial,
                "decided_at": self._decided_at,
                "subs": {n: s.state_dict() for n, s in self.subs.items()}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: everything (every candidate's state, the schedule, the
        choices) is checked first, then all of it is applied or, with a ValueError, nothing.
        A gathered checkpoint (gather_state_dict) loads on any world size; on another one than
        it was saved on, the candidates' states are resharded and the choices measured again
        from the resumed iteration (costs on one world size do not predict another's)."""
        gathered = is_gathered(sd)
        checked = whole_or_none(gathered, self.process_group, lambda: self._check_auto(sd))
        self._apply_auto(*checked)

    def _check_auto(self, sd):
        """Everything load_state_dict() checks, nothing applied."""
        sd, resized = local_state_dict(sd, self.process_group)
        if not isinstance(sd, dict):
            raise ValueError(f"state_dict must be a dict, got {type(sd).__name__}")
        if sd.get("compressor") != "auto":
            raise ValueError(f"state is for compressor {sd.get('compressor')!r}, this hook is "
                             f"'auto'")
        subs = sd.get("subs")
        if isinstance(subs, dict):
            subs = dict(subs)  # remapped below: the caller's dict stays as it was, loaded or not
            # the route candidates exist on some groups only (see GATHER, RING): a state from a
            # job with other ones (another world size or backend) lends its flat candidate's
            # state to those it lacks, and drops those it has, after lending what they hold to
            # their flat candidate where it has nothing for a bucket (quant's worker error: the
            # same kind of state by either route; the others are stateless)
            for n in [n for n in subs if _route_suffix(n) and n not in self.subs]:
                flat, gone = subs.get(_flat(n)), subs.pop(n)
                if isinstance(flat, dict) and isinstance(gone, dict) and \
                        isinstance(flat.get("buckets"), dict) and \
                        isinstance(gone.get("buckets"), dict):
                    subs[_flat(n)] = dict(flat, buckets={**gone["buckets"], **flat["buckets"]})
            for n in self.subs:
                flat = subs.get(_flat(n))
                if _route_suffix(n) and n not in subs and isinstance(flat, dict):
                    subs[n] = dict(flat, options={**(flat.get("options") or {}),
                                                  **_family(n)[1]})
        if not isinstance(subs, dict) or sorted(subs) != sorted(self.subs):
            raise ValueError(f"state has candidates {sorted(subs) if isinstance(subs, dict) else subs}"
                             f", this hook {sorted(self.subs)}")
        checked = {n: s._check_state_dict(subs[n])  # every candidate checks first
                   for n, s in self.subs.items()}
        try:
            start = _check_int("state_dict['start_iter']", sd.get("start_iter"), 0)
            it = _check_int("state_dict['iter']", sd.get("iter"), 0)
            choices = {_check_int("a choice's bucket", k if not isinstance(k, str) else int(k), 0):
                       v for k, v in sd["choices"].items()}
            # a route's choice where this group has no such candidate: the flat route (the same
            # average for fp16's and bf16's gather route; fp8's rounds the sums once more; fp16's
            # ring sums in fp16; see GATHER, RING)
            choices = {k: (_flat(v) if isinstance(v, str) and _route_suffix(v)
                           and v not in self.candidates else v) for k, v in choices.items()}
            if any(v not in self.candidates and v != "allreduce" for v in choices.values()):
                raise ValueError(f"state_dict['choices'] names unknown candidates: {choices}")
            trials = list(sd["trials"])
            trial_start = _check_int("state_dict['trial_start']", sd["trial_start"], 0)
            decided_trial, decided_at = sd["decided_trial"], sd["decided_at"]
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"state_dict of hook('auto') is incomplete or malformed: {e!r}") from None
        return (checked, resized, start, it, choices, trials, trial_start, decided_trial,
                decided_at)

    def _apply_auto(self, checked, resized, start, it, choices, trials, trial_start,
                    decided_trial, decided_at) -> None:
        for n, s in self.subs.items():
            s._apply_state_dict(checked[n])
        self._steps.reset()
        self.start_iter = start
        self.iter = it
        self.choices = choices
        self.trials = trials
        self._trial_start = trial_start
        self._decided_trial = decided_trial
        self._decided_at = decided_at
        self._clear_trial()
        self._seen = None
        if resized and it >= start:  # a trial starts with the resumed iteration
            self._trial_start = it

    def set_model(self, model) -> None:
        """GradcompState.set_model for every candidate (an unpickled hook('auto') state)."""
        for s in self.subs.values():
            s.set_model(model)

    def __getstate__(self):
        return {"options": self.options, "log_every": self.log_every, "timeout": self.timeout,
                "pipeline": self.pipeline, "gather": self._gather, "sd": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(None, d["sd"]["start_iter"], d["log_every"], None, d["timeout"],
                      pipeline=d.get("pipeline", True), _lazy=True, _gather=d.get("gather"),
                      **d["options"])
        self.load_state_dict(d["sd"])


def auto_hook(state: AutoState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook of ``hook("auto")``: runs each bucket with the candidate of this iteration
    (see the module docstring) through the per-compressor hook."""
    if not state._agreed:
        try:
            _agree_first_step(state, bucket.buffer())
        except Exception as e:  # raised once DDP has finished the step (see "Errors" in _driver)
            return _fail_after_backward(e, bucket.buffer())
    it = state.iter
    if state._seen != it:
        state._seen = it
        state._new_step(it, bucket.buffer())
    phase, name, measured = state.phase(it)
    idx = bucket.index()
    if measured:
        state._numel[idx] = bucket.buffer().numel()
    if name is None:  # chosen; a bucket the trial did not see runs the most faithful candidate
        name = state.choices.get(idx, state.candidates[0])
    sub = state.subs[name]
    sub.iter = it
    sub._calls = state._calls  # statistics of every candidate are filed under one step
    if state._worker is None:
        state._make_worker()
    if name == "allreduce":
        return _native_allreduce(state, sub, bucket, it, phase == "plain",
                                 state._sampler(name) if measured else None)
    return _hook(sub, bucket, state._sampler(name) if measured else None)


def _native_allreduce(state: AutoState, sub, bucket, it: int, plain: bool,
                      on_done) -> torch.futures.Future:
    """The plain average as DDP itself does it (torch.distributed's allreduce on the user's
    process group, issued at once, no worker thread): on a fast link nothing beats it, and auto
    must not be slower than plain DDP there. Its cost is the time from launch to completion.
    Its average is scanned for NaN/Inf in the `plain` steps before start_iter and in measured
    trial steps (so that an overflow there neither advances the schedule nor leaves a timing
    sample), and otherwise only when a compressed bucket of the same step has state to take
    back (see gradcomp.torch._Steps): a step of native buckets alone is not scanned, and an
    overflow there counts in ``iter`` (it only times the next recheck)."""


    buf = bucket.buffer()
    idx, last, world = bucket.index(), bucket.is_last(), state.world
    rec = state._steps.join(last)
    call = sub._calls
    dense = buf.numel() * buf.element_size()
    t0 = time.perf_counter()
    try:
        # DDP's own average, bit for bit: its reducer (with no hook) multiplies each gradient by
        # the reciprocal of the world size as it copies it into the bucket, then sums; PyTorch's
        # allreduce_hook divides instead (x / 3 and x * (1/3) differ in the last bit), in a pass
        # that also costs more than the multiplication
        buf.mul_(1.0 / world)
        fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
    except Exception:
        state._steps.settle(rec, True)  # the bucket joined the step: it must settle it
        raise

    def finish(f):
        stats = PlanStats()
        t1 = time.perf_counter()
        stats.comm_seconds = t1 - t0
        stats.submitted = stats.started = t0
        stats.events.append(("native allreduce", t0, t1))
        stats.collectives = 1
        stats.bytes_sent = dense
        stats.wire_bytes = wire_bytes("allreduce", dense, world)
        stats.tags.append("native allreduce")
        try:
            value = f.value()
        except Exception:
            state._steps.settle(rec, True)  # a failed collective: the step is bad
            raise
        avg = value[0] if isinstance(value, list) else value
        scan = plain or on_done is not None
        bad = scan and not bool(torch.isfinite(avg).all())
        unchecked = None if scan else avg
        if unchecked is not None and avg.is_cuda:
            # scanned at the step's end, maybe on another thread: the flag is computed here, on
            # the stream that produced the average, and an event tells when it is ready
            event = torch.cuda.Event()
            unchecked = (torch.isfinite(avg).all(), event)
            event.record()
        sub._record(call, idx, dense, stats, last, bad)
        sample = on_done(idx, it, stats) if on_done is not None else None
        state._steps.settle(rec, bad, unchecked=unchecked, sample=sample)
        return avg

    return fut.then(finish)
