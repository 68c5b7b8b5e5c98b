# SPDX-License-Identifier: Apache-2.0
"""The hook's per-bucket plans: which plan serves which DDP bucket, how a bucket's parameters are
matched to the compression state across DDP's bucket rebuild (a restored job's first iteration
runs before the rebuild, in another parameter order), and the bucket part of checkpoints."""
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ._families import _dtype_name


class _Bucket:
    __slots__ = ("plan", "numel", "dtype", "layout", "shapes", "steps")

    def __init__(self, plan, numel, dtype, layout, shapes):
        self.plan, self.numel, self.dtype, self.layout = plan, numel, dtype, layout
        self.shapes, self.steps = shapes, 0


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


class BucketTable:
    """The plans of one hook state, by DDP bucket index, with the checkpointed states not yet
    applied (``pending``: applied when DDP first calls the hook for that bucket). ``stateful``:
    whether the compressor's plans carry state (stateless ones simply follow a rebuild with a new
    plan). ``model``: when given, parameters are keyed by their index in model.parameters(), so
    state follows parameters between processes."""

    def __init__(self, stateful: bool, model=None):
        self.stateful = stateful
        self.buckets: Dict[int, _Bucket] = {}
        self.pending: Dict[int, Dict[str, Any]] = {}
        self._param_index: Optional[Dict[int, int]] = (
            None if model is None else {id(p): i for i, p in enumerate(model.parameters())})
        self._local_keys: Dict[int, int] = {}

    def layout(self, bucket) -> Tuple:
        """The bucket's parameters as keys: their index in model.parameters() when the model is
        known; otherwise keys given to the Parameter objects at first sight in this process
        (stable while the process lives, so DDP's bucket rebuild is followed either way)."""
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
        """Returns (bucket-like, _Bucket, permuted) for a compressed step; make(view, index)
        builds a new plan for a bucket-like view."""
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
        if b is None and idx in self.pending:
            p = self.pending[idx]
            if p["numel"] != buf.numel() or p["dtype"] != dt:
                raise ValueError(f"gradcomp: checkpoint has bucket {idx} with {p['numel']} "
                                 f"{p['dtype']} elements but the model's bucket has "
                                 f"{buf.numel()} {dt}")
            if p.get("keyed_by_model") and self._param_index is not None:
                saved = tuple(p["layout"])
            elif p["shapes"] == self.shapes(bucket):
                saved = layout  # no parameter identities to compare: trust the same shapes order
            else:
                raise RuntimeError(
                    f"gradcomp: checkpoint bucket {idx} holds tensors of shapes {p['shapes']} but "
                    f"the model's bucket {self.shapes(bucket)}: DDP has not rebuilt its buckets "
                    f"yet. Pass model=... to gradcomp.torch.hook (before saving and when "
                    f"restoring) so that state follows parameters")
            view = bucket if saved == layout else self._permute(bucket, layout, saved, idx)
            plan = make(view, idx)
            plan.load_state_dict(p["state"])
            del self.pending[idx]
            b = self.buckets[idx] = _Bucket(plan, buf.numel(), dt, saved, self.shapes(view))
        elif b is None:
            plan = make(bucket, idx)
            b = self.buckets[idx] = _Bucket(plan, buf.numel(), dt, layout, self.shapes(bucket))
        if b.numel != buf.numel() or b.dtype != dt:
            raise RuntimeError(
                f"gradcomp: bucket {idx} changed from {b.numel} {b.dtype} elements to "
                f"{buf.numel()} {dt} after its compression state was created; increase "
                f"start_iter past DDP's bucket rebuild (iteration 1)")
        if b.layout == layout:
            return bucket, b, False
        return self._permute(bucket, layout, b.layout, idx), b, True

    def _permute(self, bucket, layout, saved, idx):
        if sorted(layout) != sorted(saved):
            raise RuntimeError(
                f"gradcomp: bucket {idx} now holds other parameters than its compression state "
                f"was made with (DDP regrouped its buckets); start compression after DDP's bucket "
                f"rebuild (start_iter >= 2), or restore checkpoints with the same bucket sizes")
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
                              "shapes": b.shapes, "state": b.plan.state_dict()}
        for i, p in self.pending.items():
            buckets.setdefault(i, p)
        return buckets

    def load_state_dict(self, buckets: Dict[Any, Dict[str, Any]]) -> None:
        """Restores state_dict(); a bucket whose size or dtype differs from a live one is a
        ValueError raised before anything changes."""
        for i, b in buckets.items():
            cur = self.buckets.get(int(i))
            if cur is not None and (cur.numel != b["numel"] or cur.dtype != b["dtype"]):
                raise ValueError(f"bucket {i}: saved {b['numel']} {b['dtype']} elements, "
                                 f"the model has {cur.numel} {cur.dtype}")
        self.buckets = {}
        self.pending = {int(i): dict(b) for i, b in buckets.items()}
