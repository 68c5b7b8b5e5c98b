# SPDX-License-Identifier: Apache-2.0
"""DDP communication hooks, multi-process with gloo on CPU: training, consensus, traffic,
checkpoints, no_sync, AMP dtypes, unused parameters, bad input."""
import json
import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402
from gradcomp import _C  # noqa: E402
from gradcomp.torch import _driver  # noqa: E402

from ddp_util import (Net, assert_resumed_equals_straight, load_checkpoint, make_data,  # noqa: E402
                      params_equal_across_ranks, read_json, run, save_checkpoint, tmpdir,
                      train, train_losses, training_steps)

HOOKS = {
    "allreduce": {},
    "fp16": {},
    "topk": dict(ratio=0.05, momentum=0.9),
    # every tensor of this small MLP is below the default dense_below (32768), which would send
    # them all whole: 1000 samples fc1 and fc2 (6,144 elements) and sends the rest whole (648)
    "randomk": dict(ratio=0.05, dense_below=1000),
    "onebit": {},
    "quant": {},
    "powersgd": dict(rank=2),
}
# bytes handed to collectives per step must be below plain allreduce by at least this factor (a
# family not listed: no more than plain)
# (random-k: 6,792 elements over 308 sampled + 648 whole = 7.1x)
MIN_FACTOR = {"allreduce": 1.0, "fp16": 2.0, "topk": 4.0, "randomk": 5.0, "onebit": 8.0,
              "quant": 5.0, "powersgd": 3.0, "bf16": 2.0,
              "fp8": 3.5}  # a byte per value and 4 per block of 256, small buckets padded
STEPS = 50


def _train_all(rank, world, out_dir):
    data = make_data(rank, STEPS)
    results = {}
    # every registered family (a new one with its defaults), HOOKS' options where it has some
    for name in _C.plan_names():
        opts = HOOKS.get(name, {})
        torch.manual_seed(0)
        model = DDP(Net())
        state, hook = gt.hook(name, **opts)
        model.register_comm_hook(state, hook)
        mom = 0.0 if opts.get("momentum") else 0.9
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=mom)
        losses = train_losses(model, opt, data)
        same = params_equal_across_ranks(model)
        last = state.history[-1]
        results[name] = dict(first=sum(losses[:5]) / 5, last=sum(losses[-5:]) / 5, same=same,
                             sent=last["bytes_sent"], dense=last["dense_bytes"],
                             wire=last["wire_bytes"], buckets=last["buckets"],
                             iters=state.iter)
    if rank == 0:
        with open(os.path.join(out_dir, f"train_{world}.json"), "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("world", [2, 4])
def test_every_hook_trains_consistently_and_compresses(world):
    d = tmpdir()
    run(_train_all, world, d)
    res = read_json(d, f"train_{world}.json")
    # what the families' wire is judged against: the bytes a ring allreduce of the gradient
    # moves per rank, 2 (P-1)/P of it; for the families whose collectives are fp32 allreduces,
    # plain allreduce's own, by the same route (this model's buckets, and their P and Q or k
    # values, are small allreduces on gloo: one allgather each, P-1 buffers per rank)
    ring_wire = 2 * (world - 1) * res["allreduce"]["dense"] / world
    for name, r in res.items():
        plain_wire = res["allreduce"]["wire"] if name in ("randomk", "powersgd") else ring_wire
        print(f"\n{name}: sent {r['sent']} wire {r['wire']} (plain wire {plain_wire})")
        assert r["same"], f"{name}: ranks ended with different parameters"
        assert r["last"] < 0.8 * r["first"], f"{name}: loss did not decrease: {r}"
        assert r["iters"] == STEPS
        assert r["dense"] == res["allreduce"]["dense"]
        # every collective moves at most P-1 times its input per rank (ring allgather)
        assert 0 < r["wire"] <= (world - 1) * r["sent"], f"{name}: wire {r['wire']} vs {r['sent']}"
        # compression is judged on the wire: the fp16 reduce-scatter route hands its all-to-all
        # the whole buffer but moves the bytes of a ring allreduce (padding: < P elements per
        # bucket)
        pad = 8 * world * r["buckets"]
        if name == "allreduce":  # (its own route: below)
            continue
        assert r["wire"] * MIN_FACTOR.get(name, 1.0) <= plain_wire * 1.0001 + pad, \
            f"{name}: {r['wire']} bytes/step on the wire vs plain {plain_wire}, " \
            f"expected >= {MIN_FACTOR.get(name, 1.0)}x less"
    # plain allreduce: this model's buckets are small fp32 allreduces on gloo, one allgather
    # of every rank's buffer each (P-1 buffers per rank on the link; the ring's 2 (P-1)/P above
    # the driver's threshold)
    a = res["allreduce"]
    assert a["dense"] <= _driver.P2P_ALLREDUCE_BYTES
    assert a["wire"] == (world - 1) * a["dense"]


# ---- checkpoints -----------------------------------------------------------------------------
def _ckpt_run(rank, world, out_dir, name, phase):
    opts = HOOKS[name]
    data = make_data(rank, 40)
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook(name, model=model, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.0 if opts.get("momentum") else 0.9)
    path = os.path.join(out_dir, f"ckpt_{rank}.pt")
    if phase == "resume":
        load_checkpoint(path, model, opt, state)
        steps = range(20, 40)
    elif phase == "first":
        steps = range(0, 20)
    else:
        steps = range(0, 40)
    for i in steps:
        x, y = data[i]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if phase == "first":
        save_checkpoint(path, model, opt, state)
    else:
        torch.save(model.module.state_dict(), os.path.join(out_dir, f"final_{phase}_{rank}.pt"))


@pytest.mark.parametrize("name", ["topk", "onebit", "quant", "powersgd"])
def test_checkpoint_round_trip_is_identical_to_uninterrupted(name):
    d = tmpdir()
    run(_ckpt_run, 2, d, name, "first")
    run(_ckpt_run, 2, d, name, "resume")
    run(_ckpt_run, 2, d, name, "straight")
    assert_resumed_equals_straight(d, 2, name)


def _topk_exchanges(rank, world, out_dir):
    data = make_data(rank, 12)
    res = {}
    for exchange in ("auto", "bound", "sizes"):
        torch.manual_seed(0)
        model = DDP(Net())
        state, hook = gt.hook("topk", ratio=0.05, momentum=0.9, exchange=exchange)
        model.register_comm_hook(state, hook)
        train(model, torch.optim.SGD(model.parameters(), lr=0.02), data)
        res[exchange] = dict(
            params=[p.detach().clone() for p in model.parameters()],
            last_tags=[v["tags"] for _, v in sorted(state.last_stats.items())],
            collectives=[h["collectives"] for h in state.history],
            buckets=[h["buckets"] for h in state.history])
    for exchange in ("auto", "bound"):
        for a, b in zip(res[exchange]["params"], res["sizes"]["params"]):
            assert torch.equal(a, b), f"{exchange}: parameters differ from the size exchange's"
    if rank == 0:
        out = {k: {kk: vv for kk, vv in v.items() if kk != "params"} for k, v in res.items()}
        with open(os.path.join(out_dir, "exchanges.json"), "w") as f:
            json.dump(out, f)


def test_topk_bound_exchange_is_one_collective_per_bucket_with_the_same_bits():
    """exchange auto (the default) / bound: after a plan's first step (sizes, to check the
    buckets) one allgather per bucket; the same parameters bit for bit as the size exchange."""
    d = tmpdir()
    run(_topk_exchanges, 2, d)
    res = read_json(d, "exchanges.json")
    sizes = res["sizes"]
    for exchange in ("auto", "bound"):
        r = res[exchange]
        # iterations 0-1: plain allreduce (start_iter); 2: the plans' first step (sizes + payloads)
        assert r["collectives"][2] == 2 * r["buckets"][2], r
        for it in range(3, len(r["collectives"])):
            assert r["collectives"][it] == r["buckets"][it], (exchange, it, r)
            assert sizes["collectives"][it] == 2 * sizes["buckets"][it], (it, sizes)
        assert all(t == ["topk payloads (bound)"] for t in r["last_tags"]), r["last_tags"]
    assert all(t == ["topk sizes", "topk payloads"] for t in sizes["last_tags"]), sizes

def _pickles(rank, world, out_dir):
    import pickle

    if True:
        torch.manual_seed(0)
        model = DDP(Net())
        state, hook = gt.hook("topk", ratio=0.1)
        model.register_comm_hook(state, hook)
        data = make_data(rank, 5)
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
        s2 = pickle.loads(pickle.dumps(state))
        assert s2.iter == state.iter
        assert set(s2.table.pending) == set(state.buckets)
        assert s2.state_dict()["buckets"].keys() == state.state_dict()["buckets"].keys()
        # a checkpoint whose bucket size differs is rejected before anything changes
        sd = state.state_dict()
        k = next(iter(sd["buckets"]))
        sd["buckets"][k]["numel"] += 1
        before = state.state_dict()
        with pytest.raises(ValueError, match="bucket"):
            state.load_state_dict(sd)
        assert state.state_dict()["buckets"][k]["state"] == before["buckets"][k]["state"]
        # ... and by a fresh hook, at load (every bucket's state bytes are checked there)
        torch.manual_seed(0)
        fresh = DDP(Net())
        st3, h3 = gt.hook("topk", ratio=0.1)
        fresh.register_comm_hook(st3, h3)
        with pytest.raises(ValueError, match="bucket"):
            st3.load_state_dict(sd)
        assert st3.state_dict()["buckets"] == {}


def test_state_pickles_and_restores():
    run(_pickles, 2, tmpdir())


# ---- no_sync, AMP dtypes, unused parameters ---------------------------------------------------
def _features(rank, world, out_dir):
    data = make_data(rank, 12)
    # no_sync: two micro-batches accumulated locally, one compressed allreduce
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook("topk", ratio=0.1, start_iter=0)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for i in range(0, 12, 2):
        opt.zero_grad()
        with model.no_sync():
            torch.nn.functional.mse_loss(model(data[i][0]), data[i][1]).backward()
        torch.nn.functional.mse_loss(model(data[i + 1][0]), data[i + 1][1]).backward()
        opt.step()
    assert state.iter == 6, state.iter  # one hook round per synchronised step
    assert params_equal_across_ranks(model)

    # fp16 / bf16 gradients (AMP-style low-precision buckets). Torch 1.13 on CPU has no fp16
    # matmul and gloo cannot broadcast bf16, so these buckets go through the hook directly, with
    # a bucket object shaped like DDP's GradBucket
    for dt in (torch.float16, torch.bfloat16):
        for name in ("topk", "onebit", "quant", "powersgd", "randomk", "allreduce"):
            extra = {"rank": 2} if name == "powersgd" else {}
            torch.manual_seed(1 + rank)
            params = [torch.nn.Parameter(torch.randn(16, 8, dtype=dt)),
                      torch.nn.Parameter(torch.randn(16, dtype=dt))]
            state, hook = gt.hook(name, start_iter=1, **extra)
            for step in range(3):
                bucket = FakeBucket(params, [torch.randn_like(p) for p in params])
                out = hook(state, bucket).wait()
                assert out.dtype == dt
                gathered = [torch.zeros(out.numel()) for _ in range(world)]
                dist.all_gather(gathered, out.float())
                assert all(torch.equal(gathered[0], g) for g in gathered), (name, dt, step)
            if name != "allreduce":
                assert state.buckets[0].dtype == str(dt).split(".")[1], (name, dt)

    # parameters that get no gradient in a step
    torch.manual_seed(0)
    model = DDP(Net(unused=True), find_unused_parameters=True)
    state, hook = gt.hook("topk", ratio=0.2, start_iter=1)
    model.register_comm_hook(state, hook)
    train(model, torch.optim.SGD(model.parameters(), lr=0.02), data[:6])
    assert params_equal_across_ranks(model)


class FakeBucket:
    """Stands in for DDP's GradBucket: one flat buffer with per-parameter views."""

    def __init__(self, params, grads, index=0):
        self._params = params
        self._buf = torch.cat([g.reshape(-1) for g in grads])
        self._views, off = [], 0
        for g in grads:
            self._views.append(self._buf[off:off + g.numel()].view(g.shape))
            off += g.numel()
        self._index = index

    def buffer(self):
        return self._buf

    def gradients(self):
        return self._views

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return True


def test_no_sync_amp_dtypes_and_unused_parameters():
    run(_features, 2, tmpdir())


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_hook_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown compressor"):
        gt.hook("zip")
    with pytest.raises(ValueError, match="ratio"):
        gt.hook("topk", ratio=0.0)
    with pytest.raises(ValueError, match="ratio"):
        gt.hook("topk", ratio=1.5)
    with pytest.raises(ValueError, match="ratio"):
        gt.hook("randomk", ratio=-1)
    with pytest.raises(ValueError, match="rank"):
        gt.hook("powersgd", rank=0)
    with pytest.raises(ValueError, match="unknown option"):
        gt.hook("topk", rato=0.1)
    with pytest.raises(ValueError, match="momentum"):
        gt.dgc_optimizer([torch.nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.9)


def test_cuda_tensor_in_cpu_build_is_clear_error():
    if gradcomp.built_with_cuda():
        pytest.skip("built with CUDA")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        from gradcomp.torch._families import _device_of
        _device_of(_FakeCuda())


class _FakeCuda:
    is_cuda = True


def _wrong_world(rank, world, out_dir):
    state, hook = gt.hook("topk", ratio=0.1)
    sd = state.state_dict()
    sd["world_size"] = world + 1
    with pytest.raises(ValueError, match="world size"):
        state.load_state_dict(sd)


def test_wrong_process_group_size_on_load():
    run(_wrong_world, 2, tmpdir())


# ---- stateless hooks across DDP's bucket rebuild ------------------------------------------------
def _rebuild(rank, world, out_dir):
    data = make_data(rank, 4)
    for name in ("allreduce", "fp16"):
        torch.manual_seed(0)
        # torch 1.13 puts this model in one bucket in iteration 0 and rebuilds it into two
        # (the input layer gets a first bucket of its own, capped at 1 MB)
        model = DDP(Net(d_hidden=2048))
        state, hook = gt.hook(name)  # start_iter 0: compresses before the rebuild
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        # (the buckets are laid out by the backward pass; the optimizer's step leaves them)
        sizes = [sorted(b.numel for b in state.buckets.values())
                 for _ in training_steps(model, opt, data)]
        assert sizes[0] != sizes[-1], (name, sizes)  # the layout did change
        assert len(sizes[-1]) > 1, sizes
        assert params_equal_across_ranks(model)


def test_stateless_hooks_follow_ddp_bucket_rebuild():
    run(_rebuild, 2, tmpdir())


class _Bucket:
    """A stand-in for a DDP GradBucket: a flat buffer and views of it in the given shapes."""

    def __init__(self, shapes):
        sizes = [math.prod(s) for s in shapes]
        self._flat = torch.zeros(sum(sizes))
        self._grads = [v.view(s) for v, s in zip(self._flat.split(sizes), shapes)]

    def buffer(self):
        return self._flat

    def gradients(self):
        return self._grads


def test_randomk_warns_when_a_whole_bucket_is_sent_whole():
    """A bucket whose tensors all have fewer than dense_below elements is not compressed; the
    hook says so when it builds the bucket's plan, and is silent when something is sampled."""
    fam = gt.COMPRESSORS["randomk"]
    small = [[64, 32], [64], [10, 64], [10]]  # largest 2048 < 32768 (the default)
    with pytest.warns(UserWarning, match=r"bucket 3 \(4 tensors, 2762 elements, the largest "
                                         r"2048\) has fewer than dense_below=32768.*<= 2048"):
        fam.make({}, _Bucket(small), 1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        fam.make(dict(dense_below=2048), _Bucket(small), 1, 0)  # the 64 x 32 weight is sampled
        fam.make(dict(dense_below=0), _Bucket(small), 1, 0)  # every element sampled
        fam.make({}, _Bucket([[200, 200], [200]]), 1, 0)  # 40000 >= 32768: sampled
        fam.make({}, _Bucket([[0]]), 1, 0)  # nothing to send
        gt.COMPRESSORS["topk"].make({}, _Bucket(small), 1, 0)  # top-k has no dense_below
        gt.hook("randomk")  # the option check builds a plan for a small probe bucket: no warning
