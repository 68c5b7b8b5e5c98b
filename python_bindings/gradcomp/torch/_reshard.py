# SPDX-License-Identifier: Apache-2.0
"""Checkpoints that resume on another world size.

A hook's ``state_dict()`` is one rank's: residuals, errors and momenta of *that* rank, and it
loads only into a job of the same world size. :func:`gather_state_dict` collects every rank's
into one checkpoint; a hook's ``load_state_dict()`` takes that on any number of ranks:

- on as many ranks, each rank loads its own state, byte for byte (the job goes on exactly);
- on P' ranks, every bucket is resharded by ``gradcomp._C.reshard_state``: each new rank gets the
  element-wise mean over the old ranks of residuals, worker errors, errors and momenta (so their
  sum over ranks divided by the world size, the error-feedback mass the average will still
  receive, is what it was, to one fp32 rounding), 1-bit's server errors re-chunked for P' ranks
  (exactly), PowerSGD's Q and every step counter kept. ``hook("auto")`` carries its candidates'
  states and measures its choices again from the resumed iteration (costs on P ranks do not
  predict P').
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradcomp import _C

from ._buckets import _as_int
from ._compat import group_ranks

#: The key that marks a gathered checkpoint (its value: the format version).
GATHERED = "gradcomp_ranks"
_FORMAT = 1


def gather_state_dict(state, dst: int = 0) -> Optional[Dict[str, Any]]:
    """Every rank's hook state in one checkpoint that resumes on any world size.

    Collective over the hook's process group: call it on every rank, outside backward (for
    example where the model is checkpointed). Returns on rank ``dst`` of that group
    ``{"gradcomp_ranks": 1, "world_size": P, "ranks": [rank 0's state_dict(), ...]}`` and None on
    the other ranks; rank ``dst`` holds all P states (P times one rank's state in memory). With
    NCCL, torch.distributed's object gather needs ``torch.cuda.set_device`` on every rank.

    Example::

        sd = gradcomp.torch.gather_state_dict(state)
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "hook": sd}, "ckpt.pt")
        # ... later, on any number of ranks, with the same hook options:
        state.load_state_dict(torch.load("ckpt.pt")["hook"])
    """
    if not dist.is_initialized():
        raise ValueError("gather_state_dict needs an initialized process group (it gathers every "
                         "rank's state); without one, use state.state_dict()")
    group = state.process_group
    world, me = dist.get_world_size(group), dist.get_rank(group)
    dst = _as_int(dst, "dst", 0)
    if dst >= world:
        raise ValueError(f"dst must be a rank of the hook's group (0..{world - 1}), got {dst}")
    sd = state.state_dict()
    out: Optional[List[Any]] = [None] * world if me == dst else None
    dist.gather_object(sd, out, dst=group_ranks(group)[dst], group=group)
    if me != dst:
        return None
    return {GATHERED: _FORMAT, "world_size": world, "ranks": out}


def is_gathered(sd) -> bool:
    return isinstance(sd, dict) and GATHERED in sd


def local_state_dict(sd, group) -> Tuple[Any, bool]:
    """(this rank's state_dict, whether the world size changed) of a gathered checkpoint; any
    other input comes back as it is (a rank's own state_dict is checked by the hook)."""
    if not is_gathered(sd):
        return sd, False
    if not dist.is_initialized():
        raise ValueError("a gathered checkpoint (gather_state_dict) is loaded after "
                         "init_process_group: it is resharded for this rank and world size")
    if sd[GATHERED] != _FORMAT:
        raise ValueError(f"gathered checkpoint of format {sd[GATHERED]!r}; this gradcomp reads "
                         f"{_FORMAT}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return for_rank(sd, world, rank), world != sd["world_size"]


def whole_or_none(gathered: bool, group, check: Callable[[], Any]) -> Any:
    """check()'s result, or its ValueError; for a gathered checkpoint (one file that every rank
    loads) on every rank alike: the ranks tell each other whether their check passed (one
    allgather on `group`) and, if any refused, every rank raises, naming the ranks that refused.
    Checked rank by rank, a checkpoint whose ranks' states were swapped was refused by some ranks
    and taken by the others, which then trained on alone into a collective timeout. (One rank's
    own state_dict() is loaded by that rank alone: no collective.)"""
    err, out = None, None
    try:
        out = check()
    except ValueError as e:
        err = e
    if gathered and dist.is_available() and dist.is_initialized():
        dev = (torch.device("cuda", torch.cuda.current_device())
               if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        flag = torch.tensor([int(err is not None)], dtype=torch.int64, device=dev)
        got = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, flag, group=group)
        refused = [r for r, f in enumerate(got) if int(f.item())]
        if refused and err is None:
            err = ValueError(f"gathered checkpoint: refused by rank(s) {refused} (their error says "
                             f"why), so by every rank: a gathered checkpoint loads on every rank "
                             f"or on none")
    if err is not None:
        raise err
    return out


def for_rank(sd: Dict[str, Any], world: int, rank: int) -> Dict[str, Any]:
    """The state_dict of rank `rank` in a job of `world` ranks from a gathered checkpoint."""
    ranks = sd.get("ranks")
    P = _as_int(sd.get("world_size"), "gathered checkpoint: world_size", 1)
    if not isinstance(ranks, (list, tuple)) or len(ranks) != P:
        raise ValueError(f"gathered checkpoint: 'ranks' must list {P} states (one per rank), got "
                         f"{len(ranks) if isinstance(ranks, (list, tuple)) else type(ranks).__name__}")
    for r, s in enumerate(ranks):
        if not isinstance(s, dict):
            raise ValueError(f"gathered checkpoint: rank {r}'s state must be a dict, got "
                             f"{type(s).__name__}")
        if s.get("world_size") not in (None, P):
            raise ValueError(f"gathered checkpoint: rank {r}'s state was saved on "
                             f"{s.get('world_size')} ranks, the checkpoint says {P}")
    _same(ranks, _STEP_KEYS, "")
    if world == P:
        return dict(ranks[rank])
    base = ranks[0]
    if base.get("compressor") == "auto":
        subs = [s.get("subs") for s in ranks]
        if not all(isinstance(x, dict) and sorted(x) == sorted(subs[0]) for x in subs):
            raise ValueError("gathered checkpoint: the ranks' hook('auto') states have different "
                             "candidates")
        out = {}
        for n in subs[0]:
            where = f"candidate {n}: "
            _same([x[n] for x in subs], _STEP_KEYS, where)
            out[n] = _reshard([x[n] for x in subs], world, rank, where)
        return dict(base, subs=out)
    return _reshard(ranks, world, rank, "")


#: what every rank's state must hold alike to be one job's checkpoint of one step
_STEP_KEYS = ("compressor", "options", "iter", "start_iter")


def _same(ranks, keys, where: str) -> None:
    for k in keys:
        for r, s in enumerate(ranks[1:], 1):
            if s.get(k) != ranks[0].get(k):
                raise ValueError(f"gathered checkpoint: {where}rank {r} has {k}={s.get(k)!r}, rank 0 "
                                 f"{ranks[0].get(k)!r}: not one job's checkpoint of one step")


def _reshard(ranks: List[Dict[str, Any]], world: int, rank: int, where: str) -> Dict[str, Any]:
    """One hook's per-rank states (already checked with _STEP_KEYS) -> rank `rank`'s of `world`:
    each bucket's plan state through _C.reshard_state (the parameters, sizes and layout must
    agree across ranks)."""
    tables = [s.get("buckets") for s in ranks]
    if not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"gathered checkpoint: {where}a rank's 'buckets' is not a dict")
    keys = sorted(tables[0], key=repr)
    if any(sorted(t, key=repr) != keys for t in tables):
        raise ValueError(f"gathered checkpoint: {where}the ranks hold different buckets "
                         f"({[sorted(t, key=repr) for t in tables]})")
    out = {}
    for k in keys:
        entries = [t[k] for t in tables]
        if not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"gathered checkpoint: {where}bucket {k!r} is not a dict on every rank")
        _same(entries, ("numel", "dtype", "layout", "shapes", "keyed_by_model", "key_order"),
              f"{where}bucket {k!r}: ")
        states = [e.get("state") for e in entries]
        if not all(isinstance(x, (bytes, bytearray)) for x in states):
            raise ValueError(f"gathered checkpoint: {where}bucket {k!r}: every rank's state must "
                             f"be bytes")
        try:
            state = _C.reshard_state([bytes(x) for x in states], world, rank)
        except ValueError as e:
            raise ValueError(f"gathered checkpoint: {where}bucket {k!r}: {e}") from None
        out[k] = dict(entries[0], state=state)
    return dict(ranks[0], buckets=out, world_size=world)
