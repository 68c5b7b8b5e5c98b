# SPDX-License-Identifier: Apache-2.0
"""What a hook state records about its steps: per iteration totals (history), each bucket's last
step (last) and the last plan runs with every local phase and collective (runs, for
gradcomp.torch.timeline())."""
import collections
import logging
import threading
from typing import Any, Dict, List, Optional

log = logging.getLogger("gradcomp")
TIMELINE_RUNS = 512  # plan runs (bucket-steps) a state keeps for timeline()


_FIELDS = ("dense_bytes", "bytes_sent", "wire_bytes", "cross_wire_bytes", "local_seconds",
           "comm_seconds",
           "collectives", "buckets", "skipped_buckets")


class HookStats:
    """``history``: the last `max_history` steps the hook saw (memory stays bounded however long
    the job runs, and a restore at any iteration costs one entry); ``totals``: the same fields
    summed over every step since the state was made."""

    def __init__(self, compressor: str, max_runs: int, max_history: int = 4096):
        self.compressor = compressor
        self._hist: "collections.deque" = collections.deque(maxlen=max_history)
        self.totals: Dict[str, Any] = {k: 0 for k in _FIELDS}
        self.totals["steps"] = 0
        self.last: Dict[int, Dict[str, Any]] = {}
        # per plan run: when queued and started, and each local phase and collective with its
        # start and end
        self.runs: "collections.deque" = collections.deque(maxlen=max_runs)
        self.skipped_steps = 0  # steps with a bucket skipped (NaN/Inf on some rank)
        # records arrive from the worker thread and from collective callbacks (auto's native
        # allreduce) at once
        self._lock = threading.RLock()

    @property
    def history(self) -> List[Dict[str, Any]]:
        with self._lock:
            return list(self._hist)

    def iteration(self, it: int) -> Dict[str, Any]:
        """The statistics of step `it` (collectives complete asynchronously, so a bucket's
        numbers are added to the step that launched it, whenever they arrive)."""
        with self._lock:
            return self._iteration(it)

    def _iteration(self, it: int) -> Dict[str, Any]:
        for h in reversed(self._hist):  # the newest first: `it` is the current step, or close
            if h["iter"] == it:
                return h
            if h["iter"] < it:
                break
        h = {"iter": it}
        h.update({k: 0 for k in _FIELDS})
        h["local_seconds"] = h["comm_seconds"] = 0.0
        if not self._hist or self._hist[-1]["iter"] < it:
            self._hist.append(h)
            self.totals["steps"] += 1
        return h

    def record(self, it: int, bucket_index: int, dense: int, stats, last: bool,
               log_every: int = 0, skipped: bool = False) -> None:
        """Adds one bucket's finished step (a PlanStats) to its iteration, the timeline and
        last; logs the iteration's totals every log_every iterations, at its last bucket."""
        with self._lock:
            self.runs.append({"iter": it, "bucket": bucket_index, "compressor": self.compressor,
                              "submitted": stats.submitted, "started": stats.started,
                              "events": list(stats.events)})
            s = {"iter": it, "dense_bytes": dense, "bytes_sent": stats.bytes_sent,
                 "wire_bytes": stats.wire_bytes, "cross_wire_bytes": stats.cross_wire_bytes,
                 "local_seconds": stats.local_seconds, "comm_seconds": stats.comm_seconds,
                 "collectives": stats.collectives, "tags": list(stats.tags), "skipped": skipped}
            self.last[bucket_index] = s
            acc = self._iteration(it)
            add = {"dense_bytes": dense, "bytes_sent": stats.bytes_sent,
                   "wire_bytes": stats.wire_bytes, "cross_wire_bytes": stats.cross_wire_bytes,
                   "local_seconds": stats.local_seconds,
                   "comm_seconds": stats.comm_seconds, "collectives": stats.collectives,
                   "buckets": 1, "skipped_buckets": int(skipped)}
            if skipped and acc["skipped_buckets"] == 0:
                self.skipped_steps += 1
            for k, v in add.items():
                acc[k] += v
                self.totals[k] += v
            if last and log_every and it % log_every == 0:
                log.info("gradcomp %s iter %d: %d -> %d bytes (%.1fx), %.2f ms local",
                         self.compressor, it, acc["dense_bytes"], acc["bytes_sent"],
                         acc["dense_bytes"] / max(1, acc["bytes_sent"]), 1e3 * acc["local_seconds"])


def timeline(state, iteration: Optional[int] = None) -> list:
    """Where one iteration's communication time went, per bucket, from the hook's own records
    (the last iteration a state recorded when `iteration` is None). Times are milliseconds from
    the moment the iteration's first bucket was handed to the hook's worker; per bucket: when it
    was queued and when the worker started it (the wait behind earlier buckets), then its phases
    in order: ``begin`` (binding the bucket, in the hook), ``local`` (compression or decoding
    between collectives) and each collective by its tag. Works for ``hook("auto")`` too.

    Example::

        for row in gradcomp.torch.timeline(state):
            print(row["bucket"], row["queued_ms"], row["phases"])
        print(gradcomp.torch.format_timeline(gradcomp.torch.timeline(state)))
    """
    subs = getattr(state, "subs", None)
    runs = [r for s in (subs.values() if subs else [state]) for r in s.timeline]
    if not runs:
        return []
    it = max(r["iter"] for r in runs) if iteration is None else iteration
    runs = sorted((r for r in runs if r["iter"] == it), key=lambda r: r["submitted"] or 0.0)
    if not runs:
        raise ValueError(f"no record of iteration {iteration}; the state keeps the last "
                         f"{TIMELINE_RUNS} bucket runs")
    t0 = min(min([r["submitted"]] + [e[1] for e in r["events"]]) for r in runs)

    def ms(t):
        return round(1e3 * (t - t0), 3)

    return [{"iter": it, "bucket": r["bucket"], "compressor": r["compressor"],
             "queued_ms": ms(r["submitted"]), "started_ms": ms(r["started"]),
             "phases": [(what, ms(a), ms(b)) for what, a, b in r["events"]]} for r in runs]


def format_timeline(rows: list) -> str:
    """A text table of :func:`timeline`'s rows: per bucket, the wait in the worker's queue,
    then the summed milliseconds of local work and of each kind of collective, and the end."""
    lines = ["bucket  compressor  queued->started ms  local ms  collectives (ms)  done at ms"]
    for r in rows:
        local = sum(b - a for w, a, b in r["phases"] if w in ("begin", "local"))
        comm: Dict[str, float] = {}
        for w, a, b in r["phases"]:
            if w not in ("begin", "local"):
                comm[w] = comm.get(w, 0.0) + (b - a)
        end = max([r["started_ms"]] + [b for _, _, b in r["phases"]])
        coll = ", ".join(f"{k} {v:.1f}" for k, v in comm.items()) or "-"
        lines.append(f"{r['bucket']:6d}  {r['compressor']:10s}  {r['queued_ms']:7.1f}->"
                     f"{r['started_ms']:7.1f}  {local:8.1f}  {coll}  {end:.1f}")
    return "\n".join(lines)
