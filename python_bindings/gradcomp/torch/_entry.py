# SPDX-License-Identifier: Apache-2.0
"""The entry point: hook(name, ...) returns the state and hook of any compressor, "auto" too."""
from typing import Any, Optional, Tuple

from ._auto import AutoState, auto_hook
from ._hook import GradcompState, _hook


def hook(compressor: str, process_group=None, start_iter: Optional[int] = None,
         log_every: int = 0, model=None, timeout=None, pipeline: bool = True,
         **options) -> Tuple["GradcompState", Any]:
    """Returns ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Example::

        state, h = gradcomp.torch.hook("powersgd", rank=4)
        model.register_comm_hook(state, h)

    ``timeout`` (a ``datetime.timedelta`` or seconds) bounds each of the hook's collectives; by
    default the process group's own, e.g. ``init_process_group(timeout=...)``. A peer that hangs
    longer makes ``backward()`` raise.

    ``pipeline`` (default True): on CPU, the worker compresses the next bucket while the current
    one's collective is on the wire (the order of collectives is unchanged); False runs each
    bucket's phases strictly one after the other.

    ``overlap`` (default True): a bucket's exchange starts as soon as DDP hands it over, while
    backward still computes the earlier layers' gradients. False holds every bucket until the
    step's last one (the exchange then runs after backward, as an optimizer-side compressed
    allreduce such as DeepSpeed's 1-bit Adam does): the same result, bitwise; for measuring
    what the overlap is worth. Not with ``"auto"``.

    ``"auto"`` measures the candidates on the real model and link and picks per bucket (see
    :mod:`gradcomp.torch._auto`): ``hook("auto", candidates=("allreduce", "fp16", "quant", "powersgd"),
    min_rank=4, max_density=0.01, min_bits=4, trial_steps=4, recheck_every=1000,
    margin=0.05, step_margin=0.05)``.

    Every option is checked here, by the rules the C++ configuration applies: ValueError for an
    unknown compressor, option or value (ratio outside (0, 1], rank < 1, an unknown scaling, ...).
    An error in a step is raised by ``loss.backward()`` with its own type and message, after DDP
    finished the step (so the next one can run).

    ``adam`` (with ``"onebit"`` only): a :class:`gradcomp.torch.OneBitAdam`; the hook then
    averages the gradients in full precision for its ``freeze_step`` steps and the momentum
    (beta1) compressed after them (:mod:`gradcomp.torch.onebit_adam`).
    """
    adam = options.pop("adam", None)
    if adam is not None:
        if compressor != "onebit":
            raise ValueError(f"hook(adam=...) is 1-bit Adam: it needs the 'onebit' compressor, "
                             f"got {compressor!r}")
        from .onebit_adam import hook_options

        start_iter = hook_options(adam, start_iter, options)
    if compressor == "auto":
        if "overlap" in options:
            raise ValueError("hook('auto') always overlaps its exchange with backward; overlap= "
                             "is an option of the other compressors")
        return AutoState(process_group, start_iter, log_every, model, timeout, pipeline=pipeline,
                         **options), auto_hook
    state = GradcompState(compressor, process_group, start_iter, log_every, model, timeout,
                          pipeline, **options)
    state.bucket_transform = adam  # compressed steps divide the gradients by its frozen denominators
    return state, _hook
