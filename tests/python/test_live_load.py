# SPDX-License-Identifier: Apache-2.0
"""One rank loads, in a running job, a hook state whose iteration lies on the other side of
start_iter than the job's: before the check, that rank ran the compressed plan while its peer ran
the plain allreduce of the first start_iter iterations (or the reverse), and gloo aborted or
hung on collectives of different kinds and sizes. Now every rank gets a ValueError at the next
backward, again at the step after (a failed check is repeated), and once the rank has loaded a
state of the job's iteration again the ranks train on in step.

- Job in its plain steps (iteration 1 of start_iter 2), rank 0 loads the state of iteration 4
  (compressed): told by the hook's check, which runs at every step up to start_iter.
- Job compressing (iteration 4), rank 0 loads the state of iteration 1 (no compression state
  yet): that rank compresses with the job, its live plans at step 0, and the plans' own
  consensus tells every rank that the steps differ.
- Job compressing (iteration 5), rank 0 loads the state of iteration 4 (compressing too, one
  step behind): only the step envelope on each step's first collective can tell; every family
  does, 1-bit and PowerSGD included (before it they trained on from the mismatched state).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (  # noqa: E402
    fails_twice, make_data, mark_ok, params_equal_across_ranks, run_ok, train)

FAMILIES = [
    ("topk", dict(ratio=0.05)),
    ("randomk", dict(ratio=0.05, dense_below=0)),
    ("onebit", {}),
    ("powersgd", dict(rank=2)),
    ("quant", {}),
]


def _live_load_across_start_iter(rank, world, out_dir):
    data = make_data(rank, 7)

    def build(name, opts):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(32, 8))
        # (timeout: where the ranks' collectives differ, a failure in a minute, not a hang)
        state, hook = gt.hook(name, model=model, start_iter=2, timeout=60, **opts)
        model.register_comm_hook(state, hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.01)

    def job(name, opts, steps, loaded, match, back=None):
        """A job trained `steps` iterations in which rank 0 alone loads `loaded`: every rank
        fails the next backward twice (`match`); then rank 0 loads `back` (the job's own state
        from before its load, by default) and the ranks train two steps in step."""
        model, state, opt = build(name, opts)
        train(model, opt, data[0:steps])
        own = copy.deepcopy(state.state_dict())
        if rank == 0:
            state.load_state_dict(loaded)
        fails_twice(model, opt, data[steps], match)
        if rank == 0:
            state.load_state_dict(own if back is None else back)
        train(model, opt, data[5:7])
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
        assert params_equal_across_ranks(model), name
        return state, own

    for name, opts in FAMILIES:
        model, state, opt = build(name, opts)
        train(model, opt, data[0:4])
        late = copy.deepcopy(state.state_dict())  # iteration 4: compressing
        assert late["iter"] == 4 and late["buckets"]
        # a job in its plain steps (iteration 1); rank 0 loads iteration 4
        state, early = job(name, opts, 1, late, "different iterations")
        assert early["iter"] == 1 and not early["buckets"]
        assert state.iter == 3, (name, state.iter)
        # a job compressing (iteration 4); rank 0 loads iteration 1, before compression began
        state, _ = job(name, opts, 4, early, "at different steps", back=late)
        assert state.iter == 6, (name, state.iter)
        # a job compressing (iteration 5); rank 0 loads iteration 4, one compressed step behind
        state, _ = job(name, opts, 5, late, "at different steps")
        assert state.iter == 7, (name, state.iter)
    mark_ok(out_dir, rank)


def test_a_live_load_across_start_iter_fails_on_every_rank_then_trains_in_step():
    run_ok(_live_load_across_start_iter, 2)
