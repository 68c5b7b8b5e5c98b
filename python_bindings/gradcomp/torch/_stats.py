# SPDX-License-Identifier: Apache-2.0
"""What a hook state records about its steps: per iteration totals (history), each bucket's last
step (last) and the last plan runs with every local phase and collective (runs, for
gradcomp.torch.timeline())."""
import collections
import logging
from typing import Any, Dict, List

log = logging.getLogger("gradcomp")


class HookStats:
    def __init__(self, compressor: str, max_runs: int):
        self.compressor = compressor
        self.history: List[Dict[str, Any]] = []
        self.last: Dict[int, Dict[str, Any]] = {}
        # per plan run: when queued and started, and each local phase and collective with its
        # start and end
        self.runs: "collections.deque" = collections.deque(maxlen=max_runs)
        self.skipped_steps = 0  # steps with a bucket skipped (NaN/Inf on some rank)

    def iteration(self, it: int) -> Dict[str, Any]:
        """The statistics of iteration `it` (collectives complete asynchronously, so a bucket's
        numbers are added to the iteration that launched it, whenever they arrive)."""
        while len(self.history) <= it:
            self.history.append({"iter": len(self.history), "dense_bytes": 0, "bytes_sent": 0,
                                 "wire_bytes": 0, "local_seconds": 0.0, "comm_seconds": 0.0,
                                 "collectives": 0, "buckets": 0, "skipped_buckets": 0})
        return self.history[it]

    def record(self, it: int, bucket_index: int, dense: int, stats, last: bool,
               log_every: int = 0, skipped: bool = False) -> None:
        """Adds one bucket's finished step (a PlanStats) to its iteration, the timeline and
        last; logs the iteration's totals every log_every iterations, at its last bucket."""
        self.runs.append({"iter": it, "bucket": bucket_index, "compressor": self.compressor,
                          "submitted": stats.submitted, "started": stats.started,
                          "events": list(stats.events)})
        s = {"iter": it, "dense_bytes": dense, "bytes_sent": stats.bytes_sent,
             "wire_bytes": stats.wire_bytes,
             "local_seconds": stats.local_seconds, "comm_seconds": stats.comm_seconds,
             "collectives": stats.collectives, "tags": list(stats.tags), "skipped": skipped}
        self.last[bucket_index] = s
        acc = self.iteration(it)
        acc["dense_bytes"] += dense
        acc["bytes_sent"] += stats.bytes_sent
        acc["wire_bytes"] += stats.wire_bytes
        acc["local_seconds"] += stats.local_seconds
        acc["comm_seconds"] += stats.comm_seconds
        acc["collectives"] += stats.collectives
        acc["buckets"] += 1
        if skipped:
            if acc["skipped_buckets"] == 0:
                self.skipped_steps += 1
            acc["skipped_buckets"] += 1
        if last and log_every and it % log_every == 0:
            log.info("gradcomp %s iter %d: %d -> %d bytes (%.1fx), %.2f ms local",
                     self.compressor, it, acc["dense_bytes"], acc["bytes_sent"],
                     acc["dense_bytes"] / max(1, acc["bytes_sent"]), 1e3 * acc["local_seconds"])
