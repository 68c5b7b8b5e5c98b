# SPDX-License-Identifier: Apache-2.0
"""Checkpoints across world sizes: gather_state_dict() collects every rank's hook state, and a
hook's load_state_dict() takes it on any number of ranks.

- On as many ranks, the job goes on bitwise as if uninterrupted.
- On another number (4 -> 2, 2 -> 3) every family loads it, trains on in consensus, and carries
  its step (what the error-feedback mass conservation means is tested as an identity in C++,
  tests/comm/test_reshard.cpp); hook("auto") measures its choices again.
- A gathered checkpoint that is not one job's step is refused whole, naming what is wrong.
"""
import copy
import math
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (Net, assert_resumed_equals_straight, make_data, mark_ok, params_equal_across_ranks,  # noqa: E402,E501
                      run, run_ok, tmpdir, train)

FAMILIES = {
    "topk": dict(ratio=0.05),
    "randomk": dict(ratio=0.05, dense_below=0),
    "onebit": dict(),
    "quant": dict(bits=2),
    "powersgd": dict(rank=2),
    "auto": dict(trial_steps=2, candidates=["allreduce", "fp16", "powersgd"]),
}
# auto's choices follow measured times; with one candidate its run is deterministic (for bitwise)
FAMILIES["auto (one candidate)"] = dict(trial_steps=2, candidates=["powersgd"])


def _job(rank, world, out_dir, name, phase, gathered_from=None):
    """phase "first": 5 steps, then the gathered checkpoint (rank 0 saves it); "resume": loads it
    and trains 5 more; "straight": 10 steps."""
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook(name.split()[0], model=model, **FAMILIES[name])
    model.register_comm_hook(state, hook)
    if name == "auto":  # fp16's gather and ring routes are candidates of their own on more
        # than 2 gloo ranks (a checkpoint of 3 ranks resumes on 2, where they are not)
        for route in ("fp16/gather", "fp16/allreduce"):
            assert (route in state.candidates) == (world > 2), state.candidates
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = make_data(rank, 10)
    path = os.path.join(gathered_from or out_dir, "gathered.pt")
    steps = {"first": range(0, 5), "resume": range(5, 10), "straight": range(0, 10)}[phase]
    if phase == "resume":
        ck = torch.load(path)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        assert state.iter == ck["hook"]["ranks"][0]["iter"]
        if name.startswith("auto") and ck["hook"]["world_size"] != world:
            assert state._trial_start == state.iter, "auto did not measure again"
    train(model, opt, [data[i] for i in steps])
    if phase == "first":
        sd = gt.gather_state_dict(state)
        assert (sd is None) == (rank != 0)
        if rank == 0:
            assert sd["world_size"] == world and len(sd["ranks"]) == world
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": sd},
                       path)
        dist.barrier()
        return
    assert params_equal_across_ranks(model), "the ranks diverged"
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters())
    assert state.iter == 10
    if gathered_from is None:  # (compared with the straight run)
        torch.save(model.module.state_dict(), os.path.join(out_dir, f"final_{phase}_{rank}.pt"))
    else:
        mark_ok(out_dir, rank)


@pytest.mark.parametrize("name", ["topk", "onebit", "quant", "auto (one candidate)"])
def test_gathered_checkpoint_resumes_bitwise_on_as_many_ranks(name):
    d = tmpdir()
    for phase in ("first", "resume", "straight"):
        run(_job, 2, d, name, phase)
    assert_resumed_equals_straight(d, 2, name)


@pytest.mark.parametrize("name", ["topk", "randomk", "onebit", "quant", "powersgd", "auto"])
@pytest.mark.parametrize("worlds", [(4, 2), (2, 3)])
def test_gathered_checkpoint_resumes_on_another_world_size(name, worlds):
    P, P2 = worlds
    d = tmpdir()
    run(_job, P, d, name, "first")
    run_ok(_job, P2, name, "resume", d)


def _refusals(rank, world, out_dir, src):
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook("topk", model=model, **FAMILIES["topk"])
    model.register_comm_hook(state, hook)
    ck = torch.load(os.path.join(src, "gathered.pt"))["hook"]
    before = state.state_dict()

    def refused(sd, says):
        with pytest.raises(ValueError, match=says):
            state.load_state_dict(sd)
        assert state.state_dict() == before, "a refused checkpoint changed the state"

    bad = copy.deepcopy(ck)
    bad["ranks"][1]["iter"] += 1
    refused(bad, "rank 1 has iter")
    bad = copy.deepcopy(ck)
    bad["ranks"] = bad["ranks"][:1]
    refused(bad, "must list 2 states")
    bad = copy.deepcopy(ck)
    k = sorted(bad["ranks"][1]["buckets"])[0]
    st = bytearray(bad["ranks"][1]["buckets"][k]["state"])
    st[30] ^= 1
    bad["ranks"][1]["buckets"][k]["state"] = bytes(st)
    refused(bad, "rank 1's state_dict: checksum")  # (world 3: resharded, so every rank is read)
    bad = copy.deepcopy(ck)
    del bad["ranks"][1]["buckets"][k]
    refused(bad, "different buckets")
    bad = copy.deepcopy(ck)
    bad["ranks"][1]["options"] = dict(bad["ranks"][1]["options"], ratio=0.5)
    refused(bad, "rank 1 has options")
    bad = copy.deepcopy(ck)
    bad["gradcomp_ranks"] = 7
    refused(bad, "format")
    refused(dict(ck["ranks"][0]), "world size 2, the process group has 3")  # one rank's own
    state.load_state_dict(ck)  # the good one loads
    assert state.iter == ck["ranks"][0]["iter"]
    mark_ok(out_dir, rank)


def test_a_gathered_checkpoint_that_is_not_one_step_is_refused_whole():
    d = tmpdir()
    run(_job, 2, d, "topk", "first")
    run_ok(_refusals, 3, d)
    # before init_process_group it cannot be resharded: a clear error
    state, _ = gt.hook("topk", **FAMILIES["topk"])
    with pytest.raises(ValueError, match="after init_process_group"):
        state.load_state_dict(torch.load(os.path.join(d, "gathered.pt"))["hook"])


def test_gather_state_dict_needs_a_process_group():
    state, _ = gt.hook("topk", **FAMILIES["topk"])
    with pytest.raises(ValueError, match="initialized process group"):
        gt.gather_state_dict(state)
