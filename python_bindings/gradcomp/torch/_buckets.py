# SPDX-License-Identifier: Apache-2.0
"""The hook's per-bucket plans: which plan serves which DDP bucket, how a bucket's parameters are
matched to the compression state across DDP's bucket rebuild (a restored job's first iteration
runs before the rebuild, in another parameter order), and the bucket part of checkpoints."""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._families import _dtype_name


class _Bucket:
    __slots__ = ("plan", "numel", "dtype", "layout", "shapes", "steps", "device")

    def __init__(self, plan, numel, dtype, layout, shapes, device=None):
        self.plan, self.numel, self.dtype, self.layout = plan, numel, dtype, layout
        self.shapes, self.steps, self.device = shapes, 0, device


class _PermutedBucket:
    """A DDP bucket seen in another parameter order: its gradients gathered into a scratch buffer
    in the order the compression state was made with, and scattered back at the end."""

    def __init__(self, bucket, order):
        self._bucket = bucket
        grads = bucket.gradients()
        self._grads = [grads[j] for j in order]
        self._buf = torch.cat([g.reshape(-1) for g in self._grads])
        off = 0
        self._views = []
        for g in self._grads:
            self._views.append(self._buf[off:off + g.numel()].view(g.shape))
            off += g.numel()

    def buffer(self):
        return self._buf

    def gradients(self):
        return self._views

    def index(self):
        return self._bucket.index()

    def is_last(self):
        return self._bucket.is_last()

    def scatter(self):
        for g, v in zip(self._grads, self._views):
            g.copy_(v)


class _CompositePlan:
    """One DDP bucket holding the parameters of several compression states (a restored job's
    first iteration, before DDP rebuilds its buckets as the saved job had them): each state's
    plan runs on a view of its own parameters, in key order, one after another, and the views
    are scattered back into the bucket at the end (scatter()). To the hook it is a plan (begin,
    next, skipped, undo) and the bucket's view at once."""

    stateful = True

    def __init__(self, plans, views):
        self.plans, self.views = plans, views
        self._i = 0

    def buffer(self):  # (begin() binds each part's own view instead)
        return self.views[0].buffer()

    def begin(self, _flat, stream=0):
        for p, v in zip(self.plans, self.views):
            p.begin(v.buffer(), stream)
        self._i = 0

    def next(self):
        while self._i < len(self.plans):
            c = self.plans[self._i].next()
            if c is not None:
                return c
            self._i += 1
        return None

    def scatter(self):
        for v in self.views:
            v.scatter()

    @property
    def skipped(self) -> bool:
        return any(p.skipped for p in self.plans)

    @property
    def can_undo(self) -> bool:  # some part kept its step and can take it back
        return any(not p.skipped and p.can_undo for p in self.plans)

    def undo_step(self) -> None:
        for p in self.plans:
            if not p.skipped and p.can_undo:
                p.undo_step()


class BucketTable:
    """The plans of one hook state, by DDP bucket index, with the checkpointed states not yet
    applied (``pending``: applied when DDP first calls the hook for that bucket). ``stateful``:
    whether the compressor's plans carry state (stateless ones simply follow a rebuild with a new
    plan). ``model``: when given, parameters are keyed by their index in model.parameters(), so
    state follows parameters between processes."""

    def __init__(self, stateful: bool, model=None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be the DDP module or the module it wraps, got "
                             f"{type(model).__name__}")
        self.stateful = stateful
        self.buckets: Dict[int, _Bucket] = {}
        self.pending: Dict[int, Dict[str, Any]] = {}
        # the plans live when load_state_dict() was called, by key: a state loaded into a live
        # job goes into its bucket's live plan (see _apply)
        self._live: Dict[int, _Bucket] = {}
        self._param_index: Optional[Dict[int, int]] = (
            None if model is None else {id(p): i for i, p in enumerate(model.parameters())})
        self._param_shapes = (None if model is None
                              else [tuple(p.shape) for p in model.parameters()])
        self._local_keys: Dict[int, int] = {}

    def set_model(self, model) -> None:
        """Keys parameters by their index in model.parameters() from now on (a table made
        without the model: an unpickled hook state). Only before any bucket was seen, when no
        parameter has a key yet."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be the DDP module or the module it wraps, got "
                             f"{type(model).__name__}")
        if self.buckets or self._local_keys:
            raise ValueError("gradcomp: set_model() must come before the hook's first step (its "
                             "buckets are keyed already)")
        self._param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self._param_shapes = [tuple(p.shape) for p in model.parameters()]

    def layout(self, bucket) -> Tuple:
        """The bucket's parameters as keys: their index in model.parameters() when the model is
        known; otherwise keys given to the Parameter objects at first sight in this process. The
        hook looks at every bucket from the first iteration on, and a process's first iteration
        runs DDP's initial buckets, which are the same in a saved job and in its restart: so the
        keys agree between the two (and DDP's bucket rebuild is followed either way)."""
        keys = []
        for p in bucket.parameters():
            if self._param_index is not None:
                k = self._param_index.get(id(p))
                if k is None:
                    raise ValueError("gradcomp: a bucket holds a parameter that is not in the "
                                     "model given to gradcomp.torch.hook(model=...)")
            else:
                k = self._local_keys.setdefault(id(p), len(self._local_keys))
            keys.append(k)
        return tuple(keys)

    @staticmethod
    def shapes(bucket) -> list:
        return [list(g.shape) for g in bucket.gradients()]

    def resolve(self, bucket, make: Callable):
        """Returns (bucket-like, _Bucket-like, permuted) for a compressed step; make(view, index)
        builds a new plan for a bucket-like view.

        A bucket's parameters are matched to the states known (live plans and checkpointed
        states not yet applied) by their keys: the same parameters in another order are a
        permuted view; parameters that several states hold between them (a restored job's first
        iteration, which runs DDP's initial buckets before DDP rebuilds them as the saved job
        had them) run those states' plans one after another on their own parameters
        (_CompositePlan), each exactly as the saved job would have run it."""
        buf = bucket.buffer()
        idx = bucket.index()
        dt = _dtype_name(buf)
        layout = self.layout(bucket)
        b = self.buckets.get(idx)
        if b is not None and b.layout != layout and not self.stateful:
            # plain and cast plans hold no state: follow DDP's bucket rebuild with a new plan
            # (they compress from iteration 0, before the rebuild)
            b = None
            del self.buckets[idx]
        if b is None and self.pending.get(idx, {}).get("unkeyed"):
            b = self._activate_unkeyed(bucket, idx, layout, dt, make)
        if b is None or sorted(b.layout) != sorted(layout):
            cover = self._cover(layout) if (self.pending or self.buckets) else None
            if cover is None and b is None and not self._overlaps(layout):
                # parameters no state holds: a new state, under the bucket's index unless a
                # checkpointed state not applied yet has that key (it must not be hidden)
                k = idx if idx not in self.pending else 1 + max(list(self.pending) +
                                                                 list(self.buckets))
                plan = self._restarted(make(bucket, k), buf, dt, layout, self.shapes(bucket))
                b = self.buckets[k] = _Bucket(plan, buf.numel(), dt, layout,
                                              self.shapes(bucket), buf.device)
            elif cover is None:
                return self._regrouped(bucket, idx, layout)
            else:
                parts = [(k, self._activate(k, bucket, layout, dt, make)) for k in cover]
                if len(parts) == 1:
                    b = parts[0][1]
                else:
                    views = [self._permute(bucket, layout, pb.layout, k, subset=True)
                             for k, pb in parts]
                    comp = _CompositePlan([pb.plan for _, pb in parts], views)
                    return comp, _Bucket(comp, buf.numel(), dt, layout, self.shapes(bucket)), True
        if b.numel != buf.numel() or b.dtype != dt:
            raise RuntimeError(
                f"gradcomp: bucket {idx} changed from {b.numel} {b.dtype} elements to "
                f"{buf.numel()} {dt} after its compression state was created; increase "
                f"start_iter past DDP's bucket rebuild (iteration 1)")
        if b.layout == layout:
            return bucket, b, False
        return self._permute(bucket, layout, b.layout, idx), b, True

    def _restarted(self, plan, buf, dt, layout, shapes):
        """`plan`, new, for parameters no state holds; but where a state loaded into the running
        job has no entry for them (it was saved before compression began, in the plain steps of
        start_iter) and a live plan served them when it was loaded, that live plan with the new
        plan's state: it keeps what the ranks last agreed on (the sizes of its next
        collectives), so that a rank that loaded such a state alone sends what its peers expect
        and is told, with them, that its step differs (step 0 against theirs), where the new
        plan would exchange sizes while its peers send payloads (gloo aborts)."""
        for k, old in list(self._live.items()):
            if (old.numel == buf.numel() and old.dtype == dt and old.device == buf.device
                    and tuple(old.layout) == tuple(layout) and old.shapes == shapes):
                del self._live[k]
                old.plan.load_state_dict(plan.state_dict())
                return old.plan
        return plan

    def _known(self):
        """(key, layout) of every state: live plans, then checkpointed states not yet applied."""
        for k, b in self.buckets.items():
            yield k, b.layout
        for k, p in self.pending.items():
            if k not in self.buckets and not p.get("unkeyed"):
                yield k, tuple(p["layout"])

    def _cover(self, layout) -> Optional[List[int]]:
        """The keys of the states whose parameters make up exactly this bucket's (each wholly
        inside it, together all of it), in key order; None if there are none such."""
        want = set(layout)
        keys, got = [], set()
        for k, lay in self._known():
            s = set(lay)
            if s and s <= want:
                if got & s:
                    return None
                keys.append(k)
                got |= s
        return sorted(keys) if keys and got == want else None

    def _overlaps(self, layout) -> bool:
        want = set(layout)
        return any(want & set(lay) for _, lay in self._known())

    def _activate(self, k, bucket, layout, dt, make):
        """The live _Bucket of state k: a checkpointed one gets its plan now (on a view of its
        own parameters in its saved order) and its state loaded."""
        if k in self.buckets:
            return self.buckets[k]
        saved = tuple(self.pending[k]["layout"])
        view = self._permute(bucket, layout, saved, k, subset=True)
        return self._apply(k, view, saved, dt, make, "its parameters have")

    def _activate_unkeyed(self, bucket, idx, layout, dt, make):
        """A checkpointed state whose parameter keys this table cannot match (model= given on
        one side only): applied to the bucket of the same index if it holds tensors of the same
        shapes, in the saved order."""
        return self._apply(idx, bucket, layout, dt, make,
                           "the model's bucket has (and model= was given on one side only)")

    def _apply(self, k, view, layout, dt, make, whose: str):
        """Checks pending state k against the view of its parameters, builds its plan on the
        view and loads the state; the state is then live under k."""
        p = self.pending[k]
        n = view.buffer().numel()
        if p["numel"] != n or p["dtype"] != dt or p["shapes"] != self.shapes(view):
            raise ValueError(f"gradcomp: checkpoint bucket {k} holds {p['numel']} {p['dtype']} "
                             f"elements in tensors of shapes {p['shapes']}, but {whose} {n} {dt} "
                             f"in {self.shapes(view)}; pass model=... to gradcomp.torch.hook "
                             f"alike when saving and restoring (a hook state restored by "
                             f"pickle, which keeps no model: state.set_model(model) before its "
                             f"first step)")
        # A live plan of the same bucket takes the state itself: it keeps what the ranks last
        # agreed on, which sizes its next step's collectives (top-k's bound, random-k's count),
        # so that a rank that loads a state alone sends what its peers expect and is told, with
        # them, that its step differs, where a new plan would exchange sizes while its peers
        # send payloads (collectives of different sizes: gloo aborts).
        old = self._live.pop(k, None)
        device = view.buffer().device
        if (old is not None and old.numel == n and old.dtype == dt and old.device == device
                and tuple(old.layout) == tuple(layout) and old.shapes == p["shapes"]):
            plan = old.plan
        else:
            plan = make(view, k)
        plan.load_state_dict(p["state"])
        del self.pending[k]
        if not self.pending:
            self._live = {}  # (plans no state went into are dropped)
        b = self.buckets[k] = _Bucket(plan, p["numel"], dt, layout, p["shapes"], device)
        return b

    def _regrouped(self, bucket, idx, layout):
        raise RuntimeError(
            f"gradcomp: bucket {idx} now holds other parameters than the compression states "
            f"were made with, and not a whole number of them (DDP regrouped its buckets); start "
            f"compression after DDP's bucket rebuild (start_iter >= 2), or restore checkpoints "
            f"with the same bucket sizes")

    def _permute(self, bucket, layout, saved, idx, subset=False):
        """A view of the bucket's gradients in the order `saved` (all of them, or with `subset`
        some of them)."""
        if not set(saved) <= set(layout) or (not subset and len(saved) != len(layout)):
            self._regrouped(bucket, idx, layout)
        pos = {k: j for j, k in enumerate(layout)}
        return _PermutedBucket(bucket, [pos[k] for k in saved])

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[int, Dict[str, Any]]:
        """Each stateful bucket's plan state (bytes) with what identifies the bucket; states not
        yet applied are kept as they were loaded."""
        buckets = {}
        for i, b in self.buckets.items():
            if b.plan.stateful:
                buckets[i] = {"numel": b.numel, "dtype": b.dtype, "layout": list(b.layout),
                              "keyed_by_model": self._param_index is not None,
                              "key_order": KEY_ORDER, "shapes": b.shapes,
                              "state": b.plan.state_dict()}
        for i, p in self.pending.items():
            buckets.setdefault(i, p)
        return buckets

    def check_state_dict(self, buckets, check_state: Callable) -> Dict[int, Dict[str, Any]]:
        """Validates state_dict() output before anything is applied; returns it normalized.
        check_state(key, entry) validates one bucket's state bytes (a plan of that bucket's
        size loads them: header, sizes, checksum, finite values). ValueError names what is
        wrong."""
        if not isinstance(buckets, dict):
            raise ValueError(f"state_dict['buckets'] must be a dict, got {type(buckets).__name__}")
        out: Dict[int, Dict[str, Any]] = {}
        owner: Dict[int, int] = {}  # parameter key -> bucket
        params = self._param_shapes
        for i, b in buckets.items():
            k = _as_int(i, "a bucket index", 0)
            where = f"state_dict bucket {i!r}"
            if not isinstance(b, dict):
                raise ValueError(f"{where} must be a dict, got {type(b).__name__}")
            missing = [f for f in ("numel", "dtype", "layout", "shapes", "state") if f not in b]
            if missing:
                raise ValueError(f"{where} lacks {missing}")
            numel = _as_int(b["numel"], f"{where}: numel", 0)
            if b["dtype"] not in ("float32", "float16", "bfloat16"):
                raise ValueError(f"{where}: dtype must be float32, float16 or bfloat16, got "
                                 f"{b['dtype']!r}")
            if not isinstance(b["state"], (bytes, bytearray)):
                raise ValueError(f"{where}: state must be bytes, got {type(b['state']).__name__}")
            layout = [_as_int(x, f"{where}: layout entry", 0) for x in _as_list(b["layout"], where)]
            shapes = [[_as_int(d, f"{where}: shape entry", 0) for d in _as_list(sh, where)]
                      for sh in _as_list(b["shapes"], where)]
            if len(layout) != len(shapes) or len(set(layout)) != len(layout):
                raise ValueError(f"{where}: layout {layout} must name {len(shapes)} distinct "
                                 f"parameters, one per shape")
            if sum(_numel(sh) for sh in shapes) != numel:
                raise ValueError(f"{where}: shapes {shapes} hold {sum(_numel(sh) for sh in shapes)}"
                                 f" elements, numel says {numel}")
            by_model = bool(b.get("keyed_by_model", False))
            if by_model and params is not None:
                for key, sh in zip(layout, shapes):
                    if key >= len(params):
                        raise ValueError(f"{where}: layout names parameter {key}, the model has "
                                         f"{len(params)}")
                    if list(params[key]) != sh:
                        raise ValueError(f"{where}: parameter {key} has shape "
                                         f"{list(params[key])} in the model, {sh} in the "
                                         f"checkpoint")
            for key in layout:
                if key in owner:
                    raise ValueError(f"{where}: parameter {key} is also in bucket {owner[key]}")
                owner[key] = k
            # keys this table can match: both by model index, or both by first sight (a
            # checkpoint of an older gradcomp without model= keyed otherwise); an entry whose keys
            # cannot be matched (model= on one side only, e.g. an unpickled state) is applied to
            # the bucket of the same index and shapes, as saved
            keyed = by_model == (self._param_index is not None) and (
                by_model or b.get("key_order") == KEY_ORDER)
            entry = {"numel": numel, "dtype": b["dtype"], "layout": layout,
                     "keyed_by_model": by_model, "shapes": shapes, "state": bytes(b["state"])}
            if not by_model and b.get("key_order") == KEY_ORDER:
                entry["key_order"] = KEY_ORDER
            if not keyed:
                entry["unkeyed"] = True
            check_state(k, entry)
            if k in out:
                raise ValueError(f"{where}: bucket {k} given twice")
            out[k] = entry
        return out

    def load_state_dict(self, buckets: Dict[int, Dict[str, Any]]) -> None:
        """Applies what check_state_dict() returned: every bucket's state is applied when its
        parameters first reach the hook."""
        # (live plans of an earlier load that no step has taken up yet stay live: two loads
        # between steps leave the plans as one would)
        self._live.update({k: b for k, b in self.buckets.items()
                           if b.plan.stateful and not isinstance(b.plan, _CompositePlan)})
        self.buckets = {}
        self.pending = dict(buckets)


# Parameter keys without model=: given in the order DDP first shows the parameters (see
# BucketTable.layout); checkpoints record it, since older ones keyed them otherwise.
KEY_ORDER = "first_seen"


def _as_int(v, what: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) and not (
            hasattr(v, "__index__") and not isinstance(v, float)):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    v = int(v.__index__()) if not isinstance(v, int) else v
    if v < low:
        raise ValueError(f"{what} must be >= {low}, got {v}")
    return v


def _as_list(v, where: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{where}: expected a list, got {type(v).__name__}")
    return list(v)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
