# SPDX-License-Identifier: Apache-2.0
"""The fp16/bf16 cast plan's reduce-scatter route over gloo: all-to-all of wire-type
chunks, a rank-ordered fp32 sum rounded once, an allgather. Checked bit for bit against an
independent torch reference on 2 and 3 ranks (sizes 0, 1, 2, 7, 1001, 200003: empty and padded
chunks), with gloo's own all-to-all and allgather calls and with isend/irecv pairs; the gather
route (one allgather of the whole buffer, the same sum) bitwise the same; and the hook's route
choice: "auto" takes gather on 2 ranks of gloo and reduce_scatter on more, "allreduce" is
honoured, a bad route is a ValueError when the hook is made."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradcomp.torch as gt  # noqa: E402
from gradcomp import _C  # noqa: E402
from gradcomp.torch import run_sync  # noqa: E402

from ddp_util import read_json, run, tmpdir  # noqa: E402

SIZES = (0, 1, 2, 7, 1001, 200_003)  # the last: > 64 KiB per peer, point-to-point all-to-all


def _grad(rank, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(31 * rank + n)) * 3
    if n > 2:
        g[0] = 70000.0 if rank == 0 else 1e-8  # fp16 overflow after the /P and underflow
    return g


def _worker(rank, world, out_dir):
    from gradcomp.torch import _driver
    got = {}
    # p2p: None the defaults (allgathers as isend/irecv pairs); "a2a" every all-to-all as pairs
    # too, however small; "ring" every allgather through gloo's own (ring) call
    for wire, dt, p2p in (("float16", torch.float16, None), ("bfloat16", torch.bfloat16, None),
                          ("float16", torch.float16, "a2a"), ("bfloat16", torch.bfloat16, "ring"),
                          ("float16", torch.float16, "ring")):
        _driver.P2P_ALL_TO_ALL_BYTES = 0 if p2p == "a2a" else 64 * 1024
        _driver.P2P_ALLGATHER = p2p != "ring"
        for n, route in [(n, r) for n in SIZES for r in ("reduce_scatter", "gather")]:
            g = _grad(rank, n)
            plan = _C.make_plan({"float16": "fp16", "bfloat16": "bf16"}[wire], n, "float32", world,
                                options=dict(route=route))
            assert plan.route == route
            plan.begin(g)
            stats = run_sync(plan, None)
            # reference: each rank's g / P rounded to the wire type, summed in fp32 in rank
            # order, rounded once
            acc = torch.zeros(n)
            for r in range(world):
                acc = acc + (_grad(r, n) / world).to(dt).float()
            want = acc.to(dt).float()
            got[f"{wire}/{n}/{p2p}/{route}"] = dict(equal=bool(torch.equal(g, want)),
                                      err=float((g - want).abs().max()) if n else 0.0,
                                      tags=list(stats.tags))
    # one rank's gradient overflows (fp16 mixed precision): every rank ends with the same bits,
    # non-finite where the overflow was, on both routes and both allgather paths
    for route, pairs in (("reduce_scatter", True), ("gather", True), ("gather", False)):
        _driver.P2P_ALLGATHER = pairs
        g = _grad(rank, 1001)
        if rank == world - 1:
            g[5], g[700] = float("inf"), float("nan")
        plan = _C.make_plan("fp16", 1001, "float32", world, options=dict(route=route))
        plan.begin(g)
        run_sync(plan, None)
        every = [torch.zeros_like(g) for _ in range(world)]
        dist.all_gather(every, g)
        bits = [e.view(torch.int32) for e in every]
        got[f"overflow/{route}/{pairs}"] = dict(
            equal=all(torch.equal(bits[0], b) for b in bits)
            and not bool(torch.isfinite(g[[5, 700]]).any())
            and bool(torch.isfinite(g[[0, 1, 6, 699, 1000]]).all()), err=0.0, tags=[])
    _driver.P2P_ALLGATHER = True
    # the hook's choice of route on this (gloo) group
    routes = {}
    for opts in ({}, {"route": "allreduce"}, {"route": "reduce_scatter"}, {"route": "gather"}):
        fam = gt.COMPRESSORS["fp16"]
        plan = fam.make(opts, _Bucket(torch.zeros(10)), world, 0, None)
        routes[json.dumps(opts)] = plan.route
    if rank == 0:
        with open(os.path.join(out_dir, "cast.json"), "w") as f:
            json.dump(dict(got=got, routes=routes), f)


class _Bucket:
    def __init__(self, t):
        self.t = t

    def buffer(self):
        return self.t

    def gradients(self):
        return [self.t]


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_cast_matches_reference_over_gloo(world):
    d = tmpdir()
    run(_worker, world, d)
    res = read_json(d, "cast.json")
    for key, r in res["got"].items():
        assert r["equal"], f"{key}: max error {r['err']}"
        if "/0/" not in key and not key.startswith("overflow/"):
            want = ["cast gather all"] if key.endswith("/gather") else ["cast chunks", "cast gather"]
            assert r["tags"] == want, key
    # on gloo, 2 ranks: one allgather (the ring's bytes in one message round); more: two phases
    assert res["routes"] == {"{}": "gather" if world == 2 else "reduce_scatter",
                             '{"route": "allreduce"}': "allreduce",
                             '{"route": "reduce_scatter"}': "reduce_scatter",
                             '{"route": "gather"}': "gather"}


def test_bad_cast_route_is_refused_when_the_hook_is_made():
    with pytest.raises(ValueError, match="route"):
        gt.hook("fp16", route="ring")
    with pytest.raises(ValueError, match="unknown option"):
        gt.hook("bf16", ratio=0.1)
