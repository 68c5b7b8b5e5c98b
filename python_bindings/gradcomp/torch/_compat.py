# SPDX-License-Identifier: Apache-2.0
"""torch.distributed across the supported torch versions (1.13 to the newest 2.x): the public API
where there is one, the least private fallback where there is not."""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist


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
