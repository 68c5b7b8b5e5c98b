# SPDX-License-Identifier: Apache-2.0
"""compress_fsdp: FSDP2 (fully_shard) with gradcomp's reduce-scatter and allgather plans, on gloo
ranks. Lossless settings against FSDP2's own collectives bitwise; quantized ones against FSDP2's
gradients within the codec's error, their wire bytes, checkpoints, refusals and skipped steps.
The shard plans themselves are checked against scalar references in C++
(tests/quant/test_quant_plan.cpp)."""
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

import gradcomp.torch as gt
from gradcomp import _C
from ddp_util import make_data, run
from fsdp_util import HAVE_FSDP2, local_grads, local_params, needs_fsdp2, sharded_net

@pytest.mark.skipif(HAVE_FSDP2, reason="this torch has FSDP2: the refusal is for older ones")
def test_old_torch_is_refused_with_the_version():
    with pytest.raises(RuntimeError, match=torch.__version__.split("+")[0]):
        gt.compress_fsdp(torch.nn.Linear(2, 2))


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _lossless(rank, world):
    data = make_data(rank, 3)
    ref, ours = sharded_net(), sharded_net()
    comp = gt.compress_fsdp(ours, grads="allreduce", params="allreduce")
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    for x, y in data:
        _step(ref, o_ref, x, y)
        _step(ours, o_ours, x, y)
    for a, b in zip(local_params(ref), local_params(ours)):
        assert torch.equal(a, b)
    t = comp.totals()
    assert t["reduce_scatter"]["calls"] == 3 * 3  # three layers, three steps
    assert t["allgather"]["calls"] >= 3 * 3
    assert t["reduce_scatter"]["wire_bytes"] == t["reduce_scatter"]["dense_wire_bytes"] > 0


    # the README's FSDP2 example (the python block that calls compress_fsdp; found by what it
    # says, not by its place, so that other examples can be added before it) runs as written
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(readme) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    found = [b for b in blocks if "gt.compress_fsdp(" in b]
    assert len(found) == 1, f"expected one README example with compress_fsdp, found {len(found)}"
    code = found[0]
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(32, 40), torch.nn.Linear(40, 8)])
    model.forward = lambda x: model.layers[1](torch.relu(model.layers[0](x)))
    env = {"gt": gt, "model": model}
    exec(code, env)  # noqa: S102 - our own README
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    t = env["comp"].totals()
    assert t["reduce_scatter"]["calls"] == 2 and t["allgather"]["calls"] >= 2


@needs_fsdp2
def test_lossless_plans_match_fsdp2_bitwise_and_the_readme_example_runs():
    run(_lossless, 2)


def _compressed(rank, world):
    x, y = make_data(rank, 1, batch=64)[0]
    # gradients: 4-bit against FSDP2's own, within the codec's error, same on every rank
    ref, ours = sharded_net(), sharded_net()
    comp = gt.compress_fsdp(ours, grads="quant", bits=4, params="int8")
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.nn.functional.mse_loss(ours(x), y).backward()
    for a, b in zip(local_grads(ref), local_grads(ours)):
        err = (a - b).norm() / a.norm()
        assert err < 0.4, err  # one 4-bit step (no error fed back yet) with int8 weights
    t = comp.totals()
    rs, ag = t["reduce_scatter"], t["allgather"]
    assert rs["dense_wire_bytes"] / rs["wire_bytes"] > 6.0  # 4.25 bits + a 24-byte header
    assert ag["dense_wire_bytes"] / ag["wire_bytes"] > 3.0  # 8.25 bits of 32
    # the shards every rank gathered are equal: every rank sees the same rounded weights
    full = [p.full_tensor() for p in ours.parameters()]
    for f in full:
        g = [torch.empty_like(f) for _ in range(world)]
        dist.all_gather(g, f)
        assert all(torch.equal(g[0], h) for h in g)

    # checkpoint: a fresh model and compression restored from it continues bitwise
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt.step()
    sd = comp.state_dict()
    assert set(sd["modules"]) == {"fc1", "fc2", "fc3"}
    twin = sharded_net()
    with torch.no_grad():
        for p, q in zip(twin.parameters(), ours.parameters()):
            p.to_local().copy_(q.to_local())
    comp2 = gt.compress_fsdp(twin, grads="quant", bits=4, params="int8")
    comp2.load_state_dict(copy.deepcopy(sd))
    x2, y2 = make_data(rank, 1, batch=64, seed=5)[0]
    for m in (ours, twin):
        m.zero_grad()
        torch.nn.functional.mse_loss(m(x2), y2).backward()
    for a, b in zip(local_grads(ours), local_grads(twin)):
        assert torch.equal(a, b)

    # refusals, each before anything changes
    before = comp2.state_dict()
    for bad, match in [
        (dict(sd, world=world + 1), "cannot be resharded"),
        (dict(sd, grad_options={"bits": 2}), "bits"),
        (dict(sd, modules={"nope": sd["modules"]["fc1"]}), "nope"),
        (dict(sd, format="x"), "not a compress_fsdp"),
        (dict(sd, modules={k: v for k, v in sd["modules"].items() if k != "fc2"}), "fc2"),
        (dict(sd, modules=dict(sd["modules"], fc1=[dict(sd["modules"]["fc1"][0],
                                                         average="False")])), "average"),
        (dict(sd, modules=dict(sd["modules"], fc1=[dict(sd["modules"]["fc1"][0],
                                                         numel=3 << 40)])), "cannot hold"),
        (dict(sd, modules=dict(sd["modules"], fc1=[dict(sd["modules"]["fc1"][0],
                                                         numel=world * 8)])), "another model"),
    ]:
        with pytest.raises(ValueError, match=match):
            comp2.load_state_dict(bad)
    corrupt = copy.deepcopy(sd)
    blob = bytearray(corrupt["modules"]["fc2"][0]["state"])
    blob[len(blob) // 2] ^= 1
    corrupt["modules"]["fc2"][0]["state"] = bytes(blob)
    with pytest.raises(ValueError):
        comp2.load_state_dict(corrupt)
    after = comp2.state_dict()
    assert after["modules"].keys() == before["modules"].keys()
    for k in before["modules"]:
        assert after["modules"][k][0]["state"] == before["modules"][k][0]["state"]

    # a NaN on one rank: that module's shard is NaN on every rank, no error changes
    before = comp2.state_dict()
    twin.zero_grad()
    xb = x2.clone()
    if rank == 1:
        xb[0, 0] = float("nan")
    torch.nn.functional.mse_loss(twin(xb), y2).backward()
    for g in local_grads(twin):
        assert torch.isnan(g).any()
    assert comp2.settle()
    after = comp2.state_dict()
    for k in before["modules"]:
        assert after["modules"][k][0]["state"] == before["modules"][k][0]["state"]

    # top-k shards: the residual keeps what was not sent; 1% of each chunk on the wire
    sparse = sharded_net()
    comp3 = gt.compress_fsdp(sparse, grads="topk", ratio=0.01)
    torch.nn.functional.mse_loss(sparse(x), y).backward()
    rs = comp3.totals()["reduce_scatter"]
    assert rs["calls"] == 3 and rs["dense_wire_bytes"] > 4 * rs["wire_bytes"]
    gs = local_grads(sparse)
    assert all(torch.isfinite(g).all() for g in gs)
    nonzero = sum(int((g != 0).sum()) for g in gs)
    assert 0 < nonzero <= 0.1 * sum(g.numel() for g in gs)  # at most 3 ranks x 1% (+ rounding)
    assert set(comp3.state_dict()["modules"]) == {"fc1", "fc2", "fc3"}

    # a chosen subset of modules; the others keep FSDP's own collectives
    part = gt.compress_fsdp(sharded_net(), grads="quant", modules=["fc1", "fc3"])
    assert set(part.reduce_scatters) == {"fc1", "fc3"}
    with pytest.raises(ValueError, match="nope"):
        gt.compress_fsdp(sharded_net(), grads="quant", modules=["fc1", "nope"])
    # nothing to compress is an error, not a silent no-op
    with pytest.raises(ValueError, match="modules=\\[\\] names none"):
        gt.compress_fsdp(sharded_net(), grads="quant", modules=[])
    with pytest.raises(ValueError, match="no FSDP module"):
        gt.compress_fsdp(torch.nn.Linear(4, 4), grads="quant")

    # options are checked at once
    with pytest.raises(ValueError, match="rotate"):
        gt.compress_fsdp(sharded_net(), grads="quant", rotate=True)
    with pytest.raises(ValueError, match="bits"):
        gt.compress_fsdp(sharded_net(), grads="quant", params="int8", param_options={"bits": 4})
    with pytest.raises(ValueError, match="allgather form"):
        gt.compress_fsdp(sharded_net(), grads=None, params="topk")
    with pytest.raises(ValueError, match="grads"):
        gt.compress_fsdp(sharded_net(), grads="powersgd")
    # average is FSDP's to decide per call (its reduce op): a given one would be overwritten
    with pytest.raises(ValueError, match="average= is not an option"):
        gt.compress_fsdp(sharded_net(), grads="quant", average=False)


@needs_fsdp2
def test_quantized_gradients_and_weights_checkpoint_and_refusals():
    run(_compressed, 3)


def _every_family(rank, world):
    # every registered family with a shard form (a new one included, with its defaults): its
    # gradients near FSDP2's own, the same gathered weights on every rank, training going on
    x, y = make_data(rank, 1, batch=64)[0]
    forms = {f["name"]: f["shard_forms"] for f in _C.families()}
    for name in _C.shard_plan_names():
        gathers = "allgather" in forms[name]
        ref, ours = sharded_net(), sharded_net()
        gt.compress_fsdp(ours, grads=name, params=name if gathers else None)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.functional.mse_loss(ours(x), y).backward()
        for a, b in zip(local_grads(ref), local_grads(ours)):
            assert torch.isfinite(b).all(), name
            if name != "topk":  # top-k sends 1% of each chunk: not near the full gradient
                assert (a - b).norm() <= 0.5 * a.norm(), (name, float((a - b).norm() / a.norm()))
        for f in (p.full_tensor() for p in ours.parameters()):
            g = [torch.empty_like(f) for _ in range(world)]
            dist.all_gather(g, f)
            assert all(torch.equal(g[0], h) for h in g), name


@needs_fsdp2
def test_every_shard_family_through_fsdp2():
    run(_every_family, 2)
