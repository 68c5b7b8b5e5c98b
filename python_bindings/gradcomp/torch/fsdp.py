# SPDX-License-Identifier: Apache-2.0
"""Compressed communication for FSDP2 (``torch.distributed.fsdp.fully_shard``).

One line after sharding the model::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    comp = gradcomp.torch.compress_fsdp(model, grads="quant", bits=4, params="int8")

Sharded training moves gradients by a reduce-scatter (each rank keeps the average of its shard)
and parameters by an allgather. ``compress_fsdp`` gives every FSDP module of ``model`` a
reduce-scatter and, optionally, an allgather that run gradcomp's shard plans
(``gradcomp._C.make_shard_plan``; C++ ``make_shard_plan``) over the module's process group, as
ZeRO++ does (qgZ: quantized gradients, qwZ: int8 weights):

- ``grads``: ``"quant"`` (2/4/8-bit blocks with error feedback per rank, fp32 sums; options as
  the DDP hook's ``quant`` without ``rotate``), ``"topk"`` (per destination chunk the
  ``ratio`` largest of residual + gradient, residual per rank; default ratio 0.01),
  ``"bf16"`` / ``"fp16"`` (half-precision chunks,
  fp32 sums), ``"allreduce"`` (the gradient's dtype, rank-ordered fp32 sums: lossless, for
  checking), or None (FSDP's own reduce-scatter).
- ``params``: None (FSDP's own allgather, default), ``"bf16"`` / ``"fp16"`` or ``"int8"``
  (8-bit symmetric blocks of 128 with an fp32 scale each; ``"quant"`` with ``param_options`` for
  other settings). The forward and backward then compute with the gathered, rounded weights on
  every rank (a rank's own shard is rounded too, so every rank sees the same values); the
  optimizer still updates the exact fp32 shards, so the rounding does not accumulate.

Skipped steps. With ``check_finite`` (the default) a NaN/Inf in any rank's gradient makes that
module's shard NaN on every rank (a ``GradScaler`` then skips the optimizer step on every rank)
and leaves its error feedback unchanged; the other modules' steps of the same backward are
taken back when the next backward starts (or at ``state_dict()``), so a skipped step leaves no
trace in any error.

Checkpoints: ``comp.state_dict()`` (error feedback per module, plain Python data with bytes) and
``comp.load_state_dict(sd)``, validated whole before anything changes. A sharded error belongs
to its world size (FSDP pads every parameter to the number of ranks): a checkpoint from another
world size is refused with a ValueError. Frozen parameters (``requires_grad=False``) take no part
in a reduce-scatter, so the model must be frozen alike when the checkpoint is saved and loaded.

One compression per model: ``compress_fsdp`` on a model (or a part of one) whose FSDP modules
already run an earlier call's collectives raises a ValueError and changes nothing (the two
would not settle each other's skipped steps). Keep the first call's object, or shard a fresh
model for other settings.

The calls are synchronous (the collectives finish before they return), on FSDP's
reduce-scatter / all-gather stream. Needs torch with ``FSDPModule.set_custom_reduce_scatter``
(2.x); on older torch ``compress_fsdp`` raises a RuntimeError naming the version.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from gradcomp import _C

from ._driver import run_sync, wire_bytes
from ._families import _device_of, _dtype_name, _stream_of

_PARAM_ALIASES = {"int8": ("quant", {"bits": 8})}
FORMAT = "gradcomp-fsdp"
VERSION = 1


def _fsdp_api():
    """FSDP2's FSDPModule and its comm base classes, or a RuntimeError naming this torch."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except (ImportError, ValueError):  # torch 1.13's fsdp package fails to import on Python 3.11
        FSDPModule = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            "gradcomp.torch.compress_fsdp needs FSDP2 with custom collectives "
            "(torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter / "
            f"set_custom_all_gather, torch 2.x); this torch is {torch.__version__}")
    bases = (object, object)
    try:  # the base classes are private today; the call shape is what FSDP relies on
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
        bases = (ReduceScatter, AllGather)
    except ImportError:
        pass
    return FSDPModule, bases


class _Totals:
    """Bytes and time of one kind of collective, summed over calls."""

    __slots__ = ("calls", "wire_bytes", "dense_wire_bytes", "seconds")

    def __init__(self):
        self.calls = 0
        self.wire_bytes = 0        # what the gradcomp plans put on this rank's link
        self.dense_wire_bytes = 0  # what FSDP's own ring collective would have (same tensors)
        self.seconds = 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def _allocate(size, *, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


class _ShardComm:
    """What the reduce-scatter and the allgather share: the plans of one FSDP module, keyed by
    (numel, dtype, average, group size, group rank), built at the first call (or by a
    checkpoint) and kept. The group is the one FSDP hands over (the shard group: under HSDP or
    with reshard_after_forward=<int> not the global one)."""

    def __init__(self, owner: "FSDPCompression", module_name: str, family: str,
                 options: Dict[str, Any], form: str, bucket_id: int):
        self.owner = owner
        self.module_name = module_name
        self.family = family
        self.options = dict(options)
        self.form = form
        self.bucket_id = bucket_id
        self.plans: Dict[tuple, Any] = {}
        self.unused_loaded: set = set()  # keys of plans a checkpoint made that no call used yet
        self.module = None  # the FSDP module (set by compress_fsdp)
        # set when compress_fsdp failed after installing this one: FSDP offers no way to put its
        # own collective back, so this one runs it (torch.distributed's), as if never installed
        self.passthrough = False

    fsdp_module_class = None  # FSDPModule (set by compress_fsdp)

    def allocate(self, size, *, dtype, device):
        return _allocate(size, dtype=dtype, device=device)

    def expected_numel(self, world: int) -> Optional[int]:
        """The module's reduce-scatter size for a shard group of `world` ranks, from its
        trainable parameters' global shapes (FSDP2 pads dim 0 of each to a multiple of the
        group), 0 when none is trainable, or None when the module is not known or some parameter
        is not sharded on dim 0 (then the first call checks)."""
        mod = self.module
        if mod is None:
            return None
        total = 0
        # FSDP reduce-scatters only the parameters that received a gradient: a frozen one
        # (requires_grad=False) takes no part in the buffer
        for p in _trainable(_own_params(mod, type(self).fsdp_module_class)):
            placements = getattr(p, "placements", None)
            if not placements or getattr(placements[-1], "dim", None) != 0 or p.dim() == 0:
                return None
            rows = p.shape[0]
            total += -(-rows // world) * world * (p.numel() // rows if rows else 0)
        return total

    def _make(self, numel: int, dtype: str, world: int, rank: int, device: torch.device,
              stream: int, average: bool):
        opts = dict(self.options)
        if self.form == "reduce_scatter":
            opts["average"] = average
        dev = "cuda" if device.type == "cuda" else "cpu"
        return _C.make_shard_plan(self.family, numel, dtype, world, self.form, rank=rank,
                                  device=dev, device_index=device.index or 0, stream=stream,
                                  bucket_id=self.bucket_id, options=opts)

    def plan_for(self, flat: torch.Tensor, group, average: bool):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = (flat.numel(), _dtype_name(flat), average, world, rank)
        plan = self.plans.get(key)
        if plan is not None and key in self.unused_loaded and flat.is_cuda:
            # a checkpoint's plan is built on the CPU (where load_state_dict validates it): its
            # state moves into a plan on the tensor's device at the first call
            moved = self._make(key[0], key[1], world, rank, flat.device, _stream_of(flat),
                               average)
            moved.load_state_dict(plan.state_dict())
            plan = self.plans[key] = moved
        if plan is None:
            if self.unused_loaded:
                numel, dtype, avg, w, r = next(iter(self.unused_loaded))
                raise ValueError(
                    f"gradcomp FSDP: module '{self.module_name}': the checkpoint's state is for a "
                    f"{self.form} of {numel} {dtype} elements (average={avg}) as rank {r} of "
                    f"{w}, but FSDP's {self.form} has {key[0]} {key[1]} elements "
                    f"(average={average}) as rank {rank} of {world}: another model, "
                    "mixed-precision policy or group layout")
            _device_of(flat)  # a CUDA tensor in a CPU-only build: a clear error
            plan = self._make(key[0], key[1], world, rank, flat.device, _stream_of(flat), average)
            self.plans[key] = plan
        self.unused_loaded.discard(key)
        return plan


class CompressedReduceScatter(_ShardComm):
    """FSDP2's reduce-scatter through a gradcomp shard plan (``set_custom_reduce_scatter``).
    Called by FSDP as ``comm(output_tensor, input_tensor, group, op, async_op)``: input is the
    module's padded gradients, P equal chunks; output receives this rank's chunk's average
    (``op`` AVG) or sum (SUM)."""

    def __init__(self, owner, module_name, family, options, bucket_id=0):
        super().__init__(owner, module_name, family, options, "reduce_scatter", bucket_id)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if self.passthrough:
            _dense_reduce_scatter(output_tensor, input_tensor, op=op, group=group)
            return None
        try:
            average = {dist.ReduceOp.AVG: True, dist.ReduceOp.SUM: False}.get(op)
        except TypeError:  # a PREMUL_SUM op object is not hashable
            average = None
        if average is None:
            raise ValueError(
                f"gradcomp FSDP: module '{self.module_name}': reduce-scatter op {op} is not "
                "supported (AVG or SUM; FSDP passes a PREMUL_SUM when set_gradient_divide_factor "
                "is used: leave it unset)")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        flat = input_tensor.view(-1)
        if flat.numel() != output_tensor.numel() * world:
            raise ValueError(
                f"gradcomp FSDP: module '{self.module_name}': reduce-scatter input of "
                f"{flat.numel()} elements is not {world} x the output's {output_tensor.numel()}")
        plan = self.plan_for(flat, group, average)
        self.owner._steps.enter(plan)
        t0 = time.perf_counter()
        try:
            plan.begin(flat, _stream_of(flat))
            stats = run_sync(plan, group)
        finally:
            # also a step that raised (on_nonfinite="raise") is settled with the others: the
            # modules that already reduce-scattered in this backward take theirs back
            self.owner._steps.done(plan)
        output_tensor.view(-1).copy_(flat.view(world, -1)[rank])
        self.owner._record("reduce_scatter", stats, flat, world, time.perf_counter() - t0)
        return None


class CompressedAllGather(_ShardComm):
    """FSDP2's parameter allgather through a gradcomp shard plan (``set_custom_all_gather``).
    Called as ``comm(output_tensor, input_tensor, group, async_op)``: input is this rank's shard
    (FSDP places it in its slot of the output), output receives every rank's shard, rounded
    through the plan's wire format on every rank alike."""

    def __init__(self, owner, module_name, family, options, bucket_id=0):
        super().__init__(owner, module_name, family, options, "allgather", bucket_id)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        if self.passthrough:
            _dense_all_gather(output_tensor, input_tensor, group=group)
            return None
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if output_tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"gradcomp FSDP: module '{self.module_name}': params={self.owner.params!r} "
                f"gathers float parameters, but this module's all-gather buffer is "
                f"{output_tensor.dtype} (parameters of mixed dtypes travel as bytes); use "
                "params=None for it, or one parameter dtype per module")
        flat = output_tensor.view(-1)
        if flat.numel() != input_tensor.numel() * world:
            raise ValueError(
                f"gradcomp FSDP: module '{self.module_name}': all-gather output of "
                f"{flat.numel()} elements is not {world} x the input's {input_tensor.numel()}")
        own = flat.view(world, -1)[rank]
        if own.data_ptr() != input_tensor.data_ptr():
            own.copy_(input_tensor.view(-1))
        plan = self.plan_for(flat, group, True)
        t0 = time.perf_counter()
        plan.begin(flat, _stream_of(flat))
        stats = run_sync(plan, group)
        self.owner._record("allgather", stats, flat, world, time.perf_counter() - t0)
        return None


def _dense_reduce_scatter(output, input, *, op, group) -> None:
    """FSDP's own reduce-scatter (what its default comm calls; the older name before
    reduce_scatter_single), synchronous."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        output, input, op=op, group=group)


def _dense_all_gather(output, input, *, group) -> None:
    """FSDP's own all-gather (as _dense_reduce_scatter)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        output, input, group=group)


class _BackwardSteps:
    """The reduce-scatters of one backward. A module's plan called a second time means a new
    backward began: if some module of the finished one skipped its step (NaN/Inf on some rank;
    its shard is NaN on every rank, so the optimizer skips the step), every other module's step
    is taken back, so the skipped step leaves no trace in any error. Every rank sees the same
    skips, so every rank takes back the same steps."""

    def __init__(self):
        self.plans: List[Any] = []
        self.ids: set = set()

    def enter(self, plan) -> None:
        if id(plan) in self.ids:
            self.settle()

    def done(self, plan) -> None:
        self.plans.append(plan)
        self.ids.add(id(plan))

    def settle(self) -> bool:
        plans, self.plans, self.ids = self.plans, [], set()
        if not any(p.skipped for p in plans):
            return False
        for p in plans:
            if p.can_undo:
                p.undo_step()
        return True


class FSDPCompression:
    """What :func:`compress_fsdp` installed: the per-module collectives, their byte and time
    totals (``totals()``) and their checkpoint (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, grads, params, grad_options, param_options):
        self.grads = grads
        self.params = params
        self.grad_options = dict(grad_options)
        self.param_options = dict(param_options)
        self.reduce_scatters: Dict[str, CompressedReduceScatter] = {}
        self.all_gathers: Dict[str, CompressedAllGather] = {}
        self._totals = {"reduce_scatter": _Totals(), "allgather": _Totals()}
        self._steps = _BackwardSteps()
        self._world = dist.get_world_size() if dist.is_initialized() else 1

    def _record(self, kind, stats, flat, world, seconds) -> None:
        t = self._totals[kind]
        t.calls += 1
        t.wire_bytes += stats.wire_bytes
        # FSDP's own ring reduce-scatter / allgather: (P - 1) / P of the buffer on each link
        t.dense_wire_bytes += (world - 1) * flat.numel() * flat.element_size() // world
        t.seconds += seconds

    def totals(self) -> Dict[str, Dict[str, Any]]:
        """Per kind ("reduce_scatter", "allgather"): calls, wire_bytes (this rank's link),
        dense_wire_bytes (what FSDP's own collective moves for the same tensors), seconds."""
        return {k: v.as_dict() for k, v in self._totals.items()}

    def settle(self) -> bool:
        """Ends the current backward's record now (see the module docstring): if a module skipped
        its step, the others' steps are taken back. Returns whether the step was skipped.
        ``state_dict()`` calls it; a training loop need not."""
        return self._steps.settle()

    # ---- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The error feedback of every module's gradient plan (after settling the last step):
        {"format", "version", "world", "rank", "grads", "grad_options", "modules": {name:
        [{"numel", "dtype", "average", "world", "rank", "state": bytes}, ...]}} ("world" and
        "rank" at the top are the job's; an entry's are its reduce-scatter group's). Every
        compressed module that owns parameters is listed, with [] while it has no state."""
        self.settle()
        mods: Dict[str, list] = {}
        for name, comm in self.reduce_scatters.items():
            entries = []
            for (numel, dtype, average, world, rank), plan in comm.plans.items():
                if plan.stateful:
                    entries.append({"numel": numel, "dtype": dtype, "average": average,
                                    "world": world, "rank": rank, "state": plan.state_dict()})
            # a module with parameters is listed even with no state yet (frozen, not reached by
            # a backward so far, or a stateless family), so that a checkpoint that lacks it is
            # recognisably one of another model or modules= selection
            if entries or comm.module is None or _own_params(comm.module, comm.fsdp_module_class):
                mods[name] = entries
        return {"format": FORMAT, "version": VERSION, "world": self._world,
                "rank": dist.get_rank() if dist.is_initialized() else 0, "grads": self.grads,
                "grad_options": dict(self.grad_options), "modules": mods}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores state_dict() of the same model, options and world size; validated whole
        (every module's state loaded into a new plan) before anything changes: ValueError."""
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ValueError("gradcomp FSDP: not a compress_fsdp state_dict (format "
                             f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})")
        if sd.get("version") != VERSION:
            raise ValueError(f"gradcomp FSDP: state_dict version {sd.get('version')!r}, "
                             f"this gradcomp reads {VERSION}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if sd.get("world") != world:
            raise ValueError(
                f"gradcomp FSDP: the checkpoint was saved by {sd.get('world')} ranks and this "
                f"job has {world}: a sharded error feedback belongs to its world size (FSDP pads "
                "every parameter to the number of ranks) and cannot be resharded; resume on "
                f"{sd.get('world')} ranks, or call compress_fsdp afresh without loading")
        if sd.get("rank") != rank:
            raise ValueError(f"gradcomp FSDP: the checkpoint is rank {sd.get('rank')}'s, this is "
                             f"rank {rank} (load each rank's own state_dict)")
        if sd.get("grads") != self.grads or sd.get("grad_options") != self.grad_options:
            raise ValueError(
                f"gradcomp FSDP: the checkpoint was made with grads={sd.get('grads')!r} "
                f"{sd.get('grad_options')!r}, this job uses grads={self.grads!r} "
                f"{self.grad_options!r}")
        mods = sd.get("modules")
        if not isinstance(mods, dict):
            raise ValueError("gradcomp FSDP: state_dict['modules'] must be a dict")
        odd = [k for k in mods if not isinstance(k, str)]
        if odd:
            raise ValueError(f"gradcomp FSDP: state_dict['modules'] is keyed by module names "
                             f"(str), not {odd[:3]!r}")
        unknown = sorted(set(mods) - set(self.reduce_scatters))
        if unknown:
            raise ValueError(f"gradcomp FSDP: the checkpoint has state for modules {unknown}, "
                             "which this model does not have (or does not compress)")
        # the modules whose reduce-scatter can hold error feedback: those with a trainable
        # parameter (a frozen module never reduce-scatters, so a checkpoint may omit it)
        owning = {n for n, c in self.reduce_scatters.items()
                  if c.module is None or _trainable(_own_params(c.module, c.fsdp_module_class))}
        missing = sorted(owning - set(mods))
        if missing:
            raise ValueError(f"gradcomp FSDP: the checkpoint has no state for modules {missing} "
                             "(saved with other modules=, or from another model); their error "
                             "feedback would start afresh")
        staged: Dict[str, Dict[tuple, Any]] = {}
        for name, entries in mods.items():
            comm = self.reduce_scatters.get(name)
            if comm is None:
                raise ValueError(f"gradcomp FSDP: the checkpoint has state for module '{name}', "
                                 "which this model does not have (or which owns no parameters)")
            if not isinstance(entries, list):
                raise ValueError(f"gradcomp FSDP: module '{name}': a list of states expected")
            plans = {}
            for e in entries:
                key = _entry_key(name, e, world)
                numel, dtype, average, w, r = key
                if key in plans:  # one would silently win over the other
                    raise ValueError(f"gradcomp FSDP: module '{name}': two states for the same "
                                     f"reduce-scatter ({numel} {dtype} elements, average="
                                     f"{average}, rank {r} of {w})")
                expected = comm.expected_numel(w)
                if expected is not None and expected != numel:
                    raise ValueError(
                        f"gradcomp FSDP: module '{name}': the checkpoint's reduce-scatter has "
                        f"{numel} elements, this model's has {expected} (its trainable "
                        f"parameters, padded to {w} ranks): another model, or other parameters "
                        "frozen (requires_grad)")
                plan = comm._make(numel, dtype, w, r, torch.device("cpu"), 0, average)
                plan.load_state_dict(bytes(e["state"]))  # ValueError on any mismatch
                plans[key] = plan
            staged[name] = plans
        for comm in self.reduce_scatters.values():
            comm.plans = staged.pop(comm.module_name, {})
            comm.unused_loaded = set(comm.plans)
        self._steps = _BackwardSteps()


def _own_params(mod, FSDPModule) -> list:
    """The parameters an FSDP module's own group holds: its subtree's, less those of FSDP
    modules below it (which shard their own)."""
    own: list = []

    def walk(m, top: bool) -> None:
        if not top and FSDPModule is not None and isinstance(m, FSDPModule):
            return
        own.extend(m.parameters(recurse=False))
        for c in m.children():
            walk(c, False)

    walk(mod, True)
    return own


def _trainable(params) -> list:
    return [p for p in params if p.requires_grad]


# The FSDP modules of every model compress_fsdp compressed. A second compress_fsdp over any of
# them is refused: two compressions of one model would each settle skipped steps over their own
# modules only, and the first one's checkpoint would no longer describe what runs. Weak, and
# holding nothing that refers to the module, so that a model is freed as before.
_INSTALLED: "weakref.WeakSet" = weakref.WeakSet()


_ENTRY_TYPES = {"numel": int, "dtype": str, "average": bool, "world": int, "rank": int,
                "state": (bytes, bytearray)}


def _entry_key(name: str, e, job_world: int) -> tuple:
    """A checkpoint entry's plan key, every field checked for its type and range (ValueError)."""
    if not isinstance(e, dict):
        raise ValueError(f"gradcomp FSDP: module '{name}': an entry must be a dict")
    for k, t in _ENTRY_TYPES.items():
        v = e.get(k)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise ValueError(f"gradcomp FSDP: module '{name}': entry field {k!r} is "
                             f"{type(v).__name__}, not {getattr(t, '__name__', 'bytes')}")
    numel, w, r = e["numel"], e["world"], e["rank"]
    if e["dtype"] not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"gradcomp FSDP: module '{name}': entry dtype {e['dtype']!r}")
    if not (1 <= w <= job_world and 0 <= r < w and numel >= 0 and numel % w == 0):
        raise ValueError(f"gradcomp FSDP: module '{name}': entry of {numel} elements as rank "
                         f"{r} of {w} in a job of {job_world}")
    if len(e["state"]) < 4 * numel:  # the error feedback alone takes 4 bytes per element
        raise ValueError(f"gradcomp FSDP: module '{name}': a state of {len(e['state'])} bytes "
                         f"cannot hold {numel} elements")
    return (numel, e["dtype"], e["average"], w, r)


def _fsdp_modules(model, FSDPModule):
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("gradcomp FSDP: the model has no FSDP module; call fully_shard on its "
                         "layers and on the model first")
    return mods


def compress_fsdp(model, grads: Optional[str] = "quant", params: Optional[str] = None, *,
                  param_options: Optional[Dict[str, Any]] = None,
                  modules: Optional[List[str]] = None, **grad_options) -> FSDPCompression:
    """Makes every FSDP module of ``model`` reduce-scatter its gradients through gradcomp's
    ``grads`` shard plan (options: ``grad_options``, e.g. ``bits=4``) and, with ``params``,
    all-gather its parameters through the ``params`` plan (``param_options``). ``modules``: the
    names (``model.named_modules()``; "<root>" for the model itself) of the FSDP modules to
    compress, the others keeping FSDP's own collectives (e.g. an embedding or a head that is
    sensitive to rounding); default all. See the module docstring. Every option and name is
    checked here (ValueError), before any collective is replaced; so is a model that an earlier
    call already compressed (all of its FSDP modules count, also those modules= left out). A
    module that refuses a custom collective (FSDP does with several parameter groups) raises a
    ValueError, and every module keeps running FSDP's own collectives."""
    FSDPModule, (rs_base, ag_base) = _fsdp_api()
    _ShardComm.fsdp_module_class = FSDPModule
    names = list(_C.shard_plan_names())
    if grads is None and params is None:
        raise ValueError("gradcomp FSDP: grads and params are both None: nothing to compress")
    if grads is not None and grads not in names:
        raise ValueError(f"gradcomp FSDP: grads={grads!r}; choose one of {names} or None")
    if grads is None and grad_options:
        raise ValueError(f"gradcomp FSDP: options {sorted(grad_options)} given with grads=None")
    if "average" in grad_options:  # FSDP's reduce op decides it per call (AVG or SUM)
        raise ValueError("gradcomp FSDP: average= is not an option of compress_fsdp: FSDP asks "
                         "for an average or a sum on each reduce-scatter, and that is what runs")
    param_options = dict(param_options or {})
    pfamily = params
    if params in _PARAM_ALIASES:
        pfamily, fixed = _PARAM_ALIASES[params]
        for k, v in fixed.items():
            if param_options.setdefault(k, v) != v:
                raise ValueError(f"gradcomp FSDP: params={params!r} means {k}={v}, "
                                 f"got {k}={param_options[k]!r}")
    if params is not None and pfamily not in names:
        raise ValueError(f"gradcomp FSDP: params={params!r}; choose one of "
                         f"{names + list(_PARAM_ALIASES)} or None")
    if params is None and param_options:
        raise ValueError("gradcomp FSDP: param_options given with params=None")
    # the options are checked by building each plan once for a small bucket (the C++ rules)
    if grads is not None:
        _C.make_shard_plan(grads, 0, "float32", 1, "reduce_scatter", options=dict(grad_options))
    if pfamily is not None:
        _C.make_shard_plan(pfamily, 0, "float32", 1, "allgather", options=param_options)

    comp = FSDPCompression(grads, params, grad_options, param_options)
    rs_cls = type("CompressedReduceScatter", (CompressedReduceScatter, rs_base), {}) \
        if rs_base is not object else CompressedReduceScatter
    ag_cls = type("CompressedAllGather", (CompressedAllGather, ag_base), {}) \
        if ag_base is not object else CompressedAllGather
    found = [(i, name or "<root>", mod)
             for i, (name, mod) in enumerate(_fsdp_modules(model, FSDPModule))]
    taken = [label for _, label, mod in found if mod in _INSTALLED]
    if taken:
        raise ValueError(
            f"gradcomp FSDP: FSDP modules {taken} of this model already run the collectives of "
            "an earlier compress_fsdp call. A second one is refused: the two would not know of "
            "each other's skipped steps (one module's NaN/Inf must take back every module's "
            "error-feedback step) and the first one's state_dict would no longer describe what "
            "runs. Keep using the object the first call returned (its state_dict / "
            "load_state_dict carry the error feedback), or shard a fresh model for other "
            "settings")
    everything = [mod for _, _, mod in found]
    if modules is not None:
        if isinstance(modules, str):
            raise ValueError("gradcomp FSDP: modules must be a list of module names, not a str")
        known = [label for _, label, _ in found]
        unknown = sorted(set(modules) - set(known))
        if unknown:
            raise ValueError(f"gradcomp FSDP: modules {unknown} are not FSDP modules of the "
                             f"model; its FSDP modules: {known}")
        found = [f for f in found if f[1] in set(modules)]
    if not found:  # (modules=[], or a model that was never sharded): nothing would be compressed
        raise ValueError("gradcomp FSDP: no FSDP module to compress: "
                         + ("modules=[] names none" if modules is not None else
                            "the model has no FSDP module (call fully_shard on it first)"))
    for i, label, mod in found:
        try:
            if grads is not None:
                rs = rs_cls(comp, label, grads, grad_options, bucket_id=i)
                rs.module = mod
                mod.set_custom_reduce_scatter(rs)
                comp.reduce_scatters[label] = rs
            if pfamily is not None:
                ag = ag_cls(comp, label, pfamily, param_options, bucket_id=i)
                mod.set_custom_all_gather(ag)
                comp.all_gathers[label] = ag
        except BaseException as e:
            # the modules before this one already hold our collectives: they go back to FSDP's
            # own, so that a failed call leaves the model training as before it (and a later
            # call may compress it)
            for comm in (*comp.reduce_scatters.values(), *comp.all_gathers.values()):
                comm.passthrough = True
            if isinstance(e, ValueError):  # several parameter groups (shard_placement_fn), ...
                raise ValueError(f"gradcomp FSDP: module '{label}' refused a custom collective: "
                                 f"{e}") from e
            raise
    # every FSDP module of the model, also one left to FSDP by modules=: a later call on the
    # model or on a part of it would share this one's backward
    for mod in everything:
        _INSTALLED.add(mod)
    return comp


__all__ = ["compress_fsdp", "FSDPCompression", "CompressedReduceScatter", "CompressedAllGather"]
