# SPDX-License-Identifier: Apache-2.0
"""The hooks' two-level plans (hierarchy="node"): 4 gloo ranks as 2 nodes x 2 ranks."""
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

from ddp_util import Net, make_data, params_equal_across_ranks, run, train

FAMILIES = {
    "allreduce": {},
    "fp16": {},
    "topk": {"ratio": 0.05},
    "randomk": {"ratio": 0.1, "dense_below": 0},
    "onebit": {},
    "quant": {"bits": 4},
    "powersgd": {"rank": 2},
}


def _model(hook_state=None, hook=None, buckets=True):
    """The test MLP under DDP: several buckets (DDP regroups them at its rebuild after the first
    iteration on torch 2.x, so stateful hooks start at their default start_iter there) or one."""
    torch.manual_seed(0)
    m = DDP(Net(), bucket_cap_mb=0.004) if buckets else DDP(Net())
    if hook_state is not None:
        m.register_comm_hook(hook_state, hook)
    return m


def _families_train_and_agree(rank, world):
    data = make_data(rank, 6)
    for name, opts in FAMILIES.items():
        state, h = gt.hook(name, hierarchy="node", per_node=2, **opts)
        model = _model(state, h)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        train(model, opt, data)
        assert params_equal_across_ranks(model), name
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
        hist = state.history[-1]
        # inside-node collectives are not cross-node traffic; the cross part is compressed
        assert 0 < hist["cross_wire_bytes"] < hist["wire_bytes"], (name, hist)
    # the plain two-level average equals DDP's own (up to the order of fp32 sums)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    train(ref, opt, data)
    state, h = gt.hook("allreduce", hierarchy="node", per_node=2)
    model = _model(state, h)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, data)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_every_family_trains_and_ranks_agree_on_two_nodes_of_two():
    run(_families_train_and_agree, 4)


def _checkpoint_and_errors(rank, world):
    data = make_data(rank, 6)
    opts = {"ratio": 0.05}
    state, h = gt.hook("topk", hierarchy="node", per_node=2, **opts)
    model = _model(state, h)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, data[:3])
    saved = state.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    buf = io.BytesIO()
    torch.save(saved, buf)
    train(model, opt, data[3:])
    # a second job from the checkpoint goes on bitwise
    state2, h2 = gt.hook("topk", hierarchy="node", per_node=2, **opts)
    buf.seek(0)
    state2.load_state_dict(torch.load(buf))
    m2 = _model(state2, h2)
    with torch.no_grad():
        for p, q in zip(m2.parameters(), params):
            p.copy_(q)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.05)
    train(m2, opt2, data[3:])
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # a flat hook refuses the hierarchical checkpoint, and the other way round, whole
    flat, _ = gt.hook("topk", **opts)
    with pytest.raises(ValueError, match="hierarch"):
        flat.load_state_dict(saved)
    other, _ = gt.hook("topk", hierarchy="node", per_node=4, **opts)
    with pytest.raises(ValueError, match="nodes of 2 ranks"):
        other.load_state_dict(saved)
    # bad layouts
    with pytest.raises(ValueError, match="does not divide"):
        gt.hook("topk", hierarchy="node", per_node=3, **opts)
    with pytest.raises(ValueError, match="hierarchy must be"):
        gt.hook("topk", hierarchy="rack", per_node=2, **opts)
    with pytest.raises(ValueError, match="per_node"):
        gt.hook("topk", per_node=2, **opts)
    with pytest.raises(ValueError, match="per_node"):
        gt.hook("topk", hierarchy="node", per_node=0, **opts)
    with pytest.raises(ValueError, match="ratio"):
        gt.hook("topk", hierarchy="node", per_node=2, ratio=2.0)
    # ranks that disagree raise on every rank, before any group is made (no rank left waiting)
    with pytest.raises(ValueError, match="disagree on per_node"):
        gt.hook("topk", hierarchy="node", per_node=2 if rank < 2 else 4, **opts)
    os.environ["LOCAL_RANK"] = str((rank + 1) % 2)  # a launcher that numbers ranks otherwise
    try:
        with pytest.raises(ValueError, match="node-major"):
            gt.hook("topk", hierarchy="node", per_node=2, **opts)
    finally:
        del os.environ["LOCAL_RANK"]
    # the hooks still work after those errors
    state3, h3 = gt.hook("allreduce", hierarchy="node", per_node=2)
    m3 = _model(state3, h3)
    train(m3, torch.optim.SGD(m3.parameters(), lr=0.05), data[:1])


def test_checkpoint_resumes_bitwise_and_layouts_are_checked():
    run(_checkpoint_and_errors, 4)


def _nonfinite(rank, world):
    state, h = gt.hook("onebit", hierarchy="node", per_node=2, start_iter=0)
    model = _model(state, h, buckets=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = state.state_dict()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * (float("inf") if rank == 3 else 1.0)).backward()
    # every rank's gradient comes out NaN (a GradScaler skips the step everywhere)
    assert all(not torch.isfinite(p.grad).all() for p in model.parameters())
    after = state.state_dict()
    assert after["buckets"] == before["buckets"]
    assert state.skipped_steps == 1


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    run(_nonfinite, 4)


def test_plan_collectives_carry_their_scope():
    plan = _C.make_plan("topk", 1000, "float32", 4, rank=1, per_node=2,
                        options={"ratio": 0.1})
    g = torch.randn(1000)
    plan.begin(g, 0)
    c = plan.next()
    assert (c.kind, c.scope, c.world) == ("all-to-all", "node", 2)
    with pytest.raises(ValueError, match="per_node"):
        _C.make_plan("topk", 1000, "float32", 4, per_node=-1)
    with pytest.raises(ValueError, match="do not split"):
        _C.make_plan("topk", 1000, "float32", 4, per_node=3)


def _auto(rank, world):
    state, h = gt.hook("auto", hierarchy="node", per_node=2, candidates=("allreduce", "powersgd"),
                       trial_steps=2, start_iter=1)
    assert state.candidates == ["allreduce", "allreduce@node", "powersgd", "powersgd@node"]
    model = _model(state, h, buckets=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, make_data(rank, 12))
    assert params_equal_across_ranks(model)
    trial = state.trials[-1]
    for idx, costs in trial["costs"].items():
        assert set(costs) == set(state.candidates) and all(v > 0 for v in costs.values())
    assert set(state.choices.values()) <= set(state.candidates)
    # the layout travels with the state: a hook of another layout refuses it whole
    sd = state.state_dict()
    flat, _ = gt.hook("auto", candidates=("allreduce", "powersgd"), trial_steps=2)
    with pytest.raises(ValueError, match="candidates"):
        flat.load_state_dict(sd)


def test_auto_measures_each_candidate_flat_and_hierarchical():
    run(_auto, 4)
