# SPDX-License-Identifier: Apache-2.0
"""Restarts: a hook checkpoint resumes exactly, and a bad one is refused whole at load.

- 20 + 20 steps bitwise equal to 40 for every stateful family, on a model whose buckets DDP
  regroups after its first iteration (the restored job's first iteration runs DDP's initial
  buckets, each holding the parameters of several saved ones), with and without model=.
- load_state_dict checks everything first: a bad checkpoint is a ValueError naming what is
  wrong, and the state is unchanged.
- Statistics stay bounded however long the job and whatever the restored iteration.
- Options are checked: a clear ValueError, never a coercion or another exception type.
"""
import copy
import os
import pickle

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (  # noqa: E402
    Net, assert_resumed_equals_straight, fails_twice, load_checkpoint, make_data, mark_ok,
    params_equal_across_ranks, run, run_ok, save_checkpoint, tmpdir, train)

# Linear(64, 700) -> Linear(700, 700) -> Linear(700, 8): DDP's initial single bucket is regrouped
# into two after the first iteration (the probe that found restores failing)
BIG = dict(d_in=64, d_hidden=700, d_out=8)
FAMILIES = {
    "topk": dict(ratio=0.01),
    "randomk": dict(ratio=0.01),
    "onebit": dict(),
    "quant": dict(bits=4),
    "powersgd": dict(rank=2),
}


def _ckpt(rank, world, out_dir, name, phase, keyed):
    opts = FAMILIES[name]
    data = make_data(rank, 10, d_in=64, d_out=8)
    torch.manual_seed(0)
    model = DDP(Net(**BIG))
    state, hook = gt.hook(name, model=model if keyed else None, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    path = os.path.join(out_dir, f"ckpt_{rank}.pt")
    steps = {"first": range(0, 5), "resume": range(5, 10), "straight": range(0, 10)}[phase]
    if phase == "resume":
        load_checkpoint(path, model, opt, state)
    train(model, opt, [data[i] for i in steps])
    if phase == "first":
        assert len(state.buckets) >= 2, "DDP did not regroup: the test does not test"
        save_checkpoint(path, model, opt, state)
    else:
        torch.save(model.module.state_dict(), os.path.join(out_dir, f"final_{phase}_{rank}.pt"))
        torch.save({i: b.plan.state_dict() for i, b in state.buckets.items()},
                   os.path.join(out_dir, f"hook_{phase}_{rank}.pt"))


def _pickled(rank, world, out_dir, phase):
    """_ckpt's job for top-k keyed by the model, the hook state checkpointed by pickle (which
    keeps no model) and given the new model by set_model() before its first step."""
    from gradcomp.torch._hook import _hook as hook_fn
    data = make_data(rank, 10, d_in=64, d_out=8)
    torch.manual_seed(0)
    model = DDP(Net(**BIG))
    path = os.path.join(out_dir, f"pickled_{rank}")
    if phase == "resume":
        with open(path + ".hook", "rb") as f:
            state = pickle.load(f)
        state.set_model(model)
        ck = torch.load(path + ".pt")
        model.module.load_state_dict(ck["model"])
    else:
        state, _ = gt.hook("topk", model=model, **FAMILIES["topk"])
    model.register_comm_hook(state, hook_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if phase == "resume":
        opt.load_state_dict(ck["opt"])
    steps = {"first": range(0, 5), "resume": range(5, 10), "straight": range(0, 10)}[phase]
    train(model, opt, [data[i] for i in steps])
    if phase == "first":
        assert len(state.buckets) >= 2, "DDP did not regroup: the test does not test"
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, path + ".pt")
        with open(path + ".hook", "wb") as f:
            pickle.dump(state, f)
    else:
        torch.save(model.module.state_dict(), os.path.join(out_dir, f"final_{phase}_{rank}.pt"))
    if phase == "resume":  # too late now: the buckets are keyed
        with pytest.raises(ValueError, match="before the hook's first step"):
            state.set_model(model)


def test_a_pickled_state_made_with_model_resumes_bitwise_after_set_model():
    d = tmpdir()
    for phase in ("first", "resume", "straight"):
        run(_pickled, 2, d, phase)
    assert_resumed_equals_straight(d, 2, "pickled topk")


@pytest.mark.parametrize("name,keyed", [("topk", True), ("randomk", True), ("onebit", True),
                                        ("quant", True), ("powersgd", True), ("topk", False)])
def test_resume_is_bitwise_on_a_model_whose_buckets_ddp_regroups(name, keyed):
    d = tmpdir()
    for phase in ("first", "resume", "straight"):
        run(_ckpt, 2, d, name, phase, keyed)
    assert_resumed_equals_straight(d, 2, name)
    for rank in range(2):
        a = torch.load(os.path.join(d, f"hook_resume_{rank}.pt"))
        b = torch.load(os.path.join(d, f"hook_straight_{rank}.pt"))
        assert a == b, f"{name}: the compression state differs after the restore (rank {rank})"


# ---- load_state_dict validates first ------------------------------------------------------------
def _topk_ddp():
    """A small DDP model with a top-k hook (keyed by the model) and its optimizer."""
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook("topk", ratio=0.1, model=model)
    model.register_comm_hook(state, hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.01)


def _bad_loads(rank, world, out_dir):
    model, state, opt = _topk_ddp()
    data = make_data(rank, 4)
    train(model, opt, data)
    good = state.state_dict()
    k0 = sorted(good["buckets"])[0]

    def bucket_with(**kw):
        sd = copy.deepcopy(good)
        sd["buckets"][k0].update(kw)
        return sd

    st = bytearray(good["buckets"][k0]["state"])
    flipped = bytes(st[:40] + bytes([st[40] ^ 1]) + st[41:])
    bad = {
        "not a dict": [1, 2],
        "missing key": {k: v for k, v in good.items() if k != "start_iter"},
        "iter negative": dict(good, iter=-5),
        "iter not an integer": dict(good, iter=1.5),
        "start_iter negative": dict(good, start_iter=-1),
        "other compressor": dict(good, compressor="onebit"),
        "flipped byte": bucket_with(state=flipped),
        "truncated state": bucket_with(state=bytes(st[:-8])),
        "state not bytes": bucket_with(state="abc"),
        "no state key": {**good, "buckets": {k0: {k: v for k, v in good["buckets"][k0].items()
                                                  if k != "state"}}},
        "reversed layout": bucket_with(layout=list(reversed(good["buckets"][k0]["layout"]))),
        "unknown parameter": bucket_with(layout=[99] * len(good["buckets"][k0]["layout"])),
        "bucket index not an int": {**good, "buckets": {"x": good["buckets"][k0]}},
        "other options": dict(good, options={**good["options"], "ratio": 0.5}),
        "options not a dict": dict(good, options=[("ratio", 0.5)]),
    }
    before = pickle.dumps(state.state_dict())
    for what, sd in bad.items():
        with pytest.raises(ValueError):
            state.load_state_dict(sd)
        assert pickle.dumps(state.state_dict()) == before, f"{what}: the state changed"
        assert state.iter == len(data)
    # and the model trains on, the good checkpoint still loads
    state.load_state_dict(good)
    train(model, opt, data)
    mark_ok(out_dir, rank)


def test_load_state_dict_refuses_a_bad_checkpoint_whole():
    run_ok(_bad_loads, 2)


def _gathered_all_or_none(rank, world, out_dir):
    import torch.distributed as dist
    model, state, opt = _topk_ddp()
    train(model, opt, make_data(rank, 3))
    box = [gt.gather_state_dict(state)]  # (on rank 0; every rank loads the same file)
    dist.broadcast_object_list(box, src=0)
    good = box[0]
    bad = copy.deepcopy(good)  # rank 1's own state damaged: only rank 1 can see it
    k0 = sorted(bad["ranks"][1]["buckets"])[0]
    st = bytearray(bad["ranks"][1]["buckets"][k0]["state"])
    st[40] ^= 1
    bad["ranks"][1]["buckets"][k0]["state"] = bytes(st)
    before = pickle.dumps(state.state_dict())
    with pytest.raises(ValueError) as e:
        state.load_state_dict(bad)
    if rank != 1:  # the ranks whose own part was fine refuse too, naming the rank that refused
        assert "refused by rank(s) [1]" in str(e.value), str(e.value)
    assert pickle.dumps(state.state_dict()) == before
    state.load_state_dict(good)  # the good checkpoint loads on every rank, training goes on
    train(model, opt, make_data(rank, 2))
    assert params_equal_across_ranks(model)
    mark_ok(out_dir, rank)


def test_a_gathered_checkpoint_is_refused_by_every_rank_or_by_none():
    run_ok(_gathered_all_or_none, 3)


def test_a_checkpoint_loads_only_with_the_options_it_was_made_with():
    """A state belongs to its options (a top-k residual of ratio 0.05 is not one of 0.1): other
    options are refused naming each one, defaults count as given; options that change neither
    the state nor the math (how a step checks its input, the exchange) may differ."""
    sd = gt.hook("topk", ratio=0.05, momentum=0.9)[0].state_dict()
    for kw, named in ((dict(ratio=0.1, momentum=0.9), "ratio=0.05"),
                      (dict(ratio=0.05), "momentum=0.9"),
                      (dict(ratio=0.05, momentum=0.9, method="exact"), "method=")):
        state = gt.hook("topk", **kw)[0]
        before = pickle.dumps(state.state_dict())
        with pytest.raises(ValueError, match=named):
            state.load_state_dict(sd)
        assert pickle.dumps(state.state_dict()) == before
    defaults = gt.COMPRESSORS["topk"].defaults
    explicit = gt.hook("topk", ratio=0.05, momentum=0.9, seed=defaults["seed"],
                       check_finite=False, on_nonfinite="raise")[0]
    explicit.load_state_dict(sd)  # a default given by name, and operational options: loads
    q = gt.hook("quant", bits=2)[0].state_dict()
    with pytest.raises(ValueError, match="bits=2"):
        gt.hook("quant")[0].load_state_dict(q)
    # another accepted spelling of an option is that option (saved, compared and digested so)
    for name, spelling, option, value in (("onebit", "chunk_size", "block_size", 64),
                                          ("powersgd", "error_feedback", "use_error_feedback",
                                           False)):
        old = gt.hook(name, **{spelling: value})[0]
        assert old.options == {option: value}
        new = gt.hook(name, **{option: value})[0]
        new.load_state_dict(old.state_dict())
        old.load_state_dict(new.state_dict())
        with pytest.raises(ValueError, match=option):
            gt.hook(name)[0].load_state_dict(old.state_dict())


# ---- bounded statistics -------------------------------------------------------------------------
def _history(rank, world, out_dir):
    model, state, opt = _topk_ddp()
    batch = make_data(rank, 1)
    train(model, opt, batch * 3)
    sd = state.state_dict()
    sd["iter"] = 3_000_000  # a restore deep into a long job
    state.load_state_dict(sd)
    state.stats._hist = type(state.stats._hist)(maxlen=8)  # a short ring to fill quickly
    train(model, opt, batch * 20)
    assert len(state.history) == 8
    assert state.iter == 3_000_020
    assert state.totals["steps"] == 23 and state.totals["buckets"] >= 23
    mark_ok(out_dir, rank)


def test_statistics_stay_bounded_and_a_deep_restore_is_cheap():
    run_ok(_history, 2)


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(start_iter=1.5), dict(start_iter="2"), dict(start_iter=True),
                                dict(log_every=-1), dict(timeout=1e300), dict(model=3)])
def test_hook_options_are_checked_not_coerced(kw):
    with pytest.raises(ValueError):
        gt.hook("topk", ratio=0.1, **kw)


def test_numpy_and_torch_scalars_are_read_as_their_values():
    np = pytest.importorskip("numpy")
    from gradcomp import _C
    from gradcomp.bench import run_local  # drives a world-size-1 plan

    def plan(**opts):
        return _C.make_plan("topk", 64, "float32", 1, options=opts)

    # 0-d arrays and scalar tensors stand for their one value
    p = plan(ratio=np.array(0.25), momentum=torch.tensor(0.5), warmup_steps=np.array(3))
    assert p.numel == 64
    # np.bool_ is a bool, as True is: check_finite off keeps no copy to undo a step with
    for off in (np.bool_(False), False):
        q = plan(ratio=0.25, check_finite=off)
        g = np.ones(64, dtype=np.float32)
        q.begin(g)
        run_local(q)
        assert not q.can_undo
    with pytest.raises(ValueError, match="ratio"):
        plan(ratio=np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="check_finite"):
        plan(check_finite=np.int64(1))  # a number is not a bool


def test_an_enum_member_counts_only_for_its_own_enum():
    from gradcomp import _C
    # TopKRoute.auto shares its name with the cast plans' route "auto": as a member it is refused
    with pytest.raises(ValueError, match="expected a cast route.*top-k route 'auto'"):
        _C.make_plan("fp16", 64, "float32", 2, options=dict(route=_C.TopKRoute.auto))
    with pytest.raises(ValueError, match="expected a top-k route"):
        _C.make_plan("topk", 64, "float32", 2, options=dict(route=_C.CastRoute.allreduce))
    with pytest.raises(ValueError, match="expected a dtype"):
        gt.hook("topk", ratio=0.1, value_dtype=_C.OnNonFinite.skip)
    # its own enum's members, and plain names, are taken
    assert _C.make_plan("fp16", 64, "float32", 2,
                        options=dict(route=_C.CastRoute.allreduce)).numel == 64
    assert _C.make_plan("topk", 64, "float32", 2, options=dict(
        route=_C.TopKRoute.dense, value_dtype=_C.DType.float16)).numel == 64
    assert _C.make_plan("fp16", 64, "float32", 2, options=dict(route="auto")).numel == 64


def test_onebit_block_size_is_bounded_and_named():
    with pytest.raises(ValueError, match="block_size"):
        gt.hook("onebit", block_size=2 ** 40, rotate=False)
    with pytest.raises(ValueError, match="block_size"):
        gt.hook("onebit", block_size=48)


def test_a_step_closes_even_if_taking_back_a_bucket_fails():
    from gradcomp.torch._hook import _Steps

    class Owner:
        closed = []

        def _close_step(self, applied, samples):
            self.closed.append(applied)

    class Broken:
        can_undo = True

        def undo_step(self):
            raise RuntimeError("undo failed")

    steps = _Steps(Owner())
    rec = steps.join(False)
    assert steps.join(True) is rec
    steps.settle(rec, False, kept=Broken())
    with pytest.raises(RuntimeError, match="undo failed"):
        steps.settle(rec, True)  # the second bucket skipped: the first is taken back (fails)
    assert Owner.closed == [False] and steps._open is None  # closed all the same
    assert steps.join(True) is not rec  # the next step is a new one


def test_auto_load_state_dict_checks_every_candidate_before_applying():
    state, _ = gt.hook("auto", trial_steps=2, start_iter=1)
    sd = state.state_dict()
    before = pickle.dumps(state.state_dict())
    bad_sub = copy.deepcopy(sd)
    bad_sub["subs"]["powersgd"]["iter"] = -1
    bad_choice = copy.deepcopy(sd)
    bad_choice["choices"] = {0: "bogus"}
    for bad in ([], dict(sd, iter=1.5), bad_sub, bad_choice,
                {k: v for k, v in sd.items() if k != "trials"}):
        with pytest.raises(ValueError):
            state.load_state_dict(bad)
        assert pickle.dumps(state.state_dict()) == before


# ---- one rank loads another step's state into a live job -------------------------------------
# Inside a warm-up, k (so every collective's size) changes at each step: a rank that loads an
# older state alone must get, with its peers, a ValueError at the next backward, never gloo's
# abort on collectives of different sizes; the step after is checked again, and once the rank has
# its own state back the job trains on with the ranks in step.
WARMUP = dict(warmup_ratios=[0.3, 0.2, 0.1, 0.05], warmup_steps=1)
ALONE = [
    ("topk", dict(ratio=0.01, exchange="bound", **WARMUP)),
    ("topk", dict(ratio=0.01, exchange="auto", **WARMUP)),
    ("topk", dict(ratio=0.01, route="dense", **WARMUP)),
    ("randomk", dict(ratio=0.01, dense_below=0, **WARMUP)),
]


def _hooked(name, **opts):
    """A DDP Net (seed 0) with the hook `name` (given the model) and its SGD optimizer."""
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook(name, model=model, **opts)
    model.register_comm_hook(state, hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.01)


def _told_then_agree(rank, model, opt, state, batch, match, alone, agree):
    """alone = (r, state_dict): rank r loads a state the other ranks do not have, and every rank's
    next step fails, twice, naming `match` (fails_twice); then agree = (r, state_dict) is loaded on
    rank r, after which the ranks agree again."""
    r, sd = alone
    if rank == r:
        state.load_state_dict(sd)
    fails_twice(model, opt, batch, match)
    r, sd = agree
    if rank == r:
        state.load_state_dict(sd)


def _one_rank_loads_alone(rank, world, out_dir):
    data = make_data(rank, 8)
    for name, opts in ALONE:
        model, state, opt = _hooked(name, start_iter=0, **opts)
        train(model, opt, data[0:2])
        older = copy.deepcopy(state.state_dict())
        train(model, opt, data[2:4])
        mine = copy.deepcopy(state.state_dict())
        _told_then_agree(rank, model, opt, state, data[4], "ranks are at different steps",
                         (0, older), (0, mine))
        train(model, opt, data[4:8])
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert params_equal_across_ranks(model), (name, opts)
    mark_ok(out_dir, rank)


def test_a_rank_loading_another_step_alone_is_told_on_every_rank_inside_a_warm_up():
    run_ok(_one_rank_loads_alone, 2)


# ---- a fresh job where one rank restores its checkpoint and the other does not -----------------
# The restored rank compresses from its first step while its peer runs the plain allreduce of
# start_iter: without a check the two issue different collectives (gloo: abort or hang). The
# first step of a hook state compares (iteration, start_iter, options) across ranks.
def _restored_alone(rank, world, out_dir):
    data = make_data(rank, 12)
    cases = [(n, o) for n, o in FAMILIES.items()] + [("auto", dict(trial_steps=2))]
    for name, opts in cases:
        model, state, opt = _hooked(name, **opts)
        train(model, opt, data[0:5])
        sd = copy.deepcopy(state.state_dict())
        model, state, opt = _hooked(name, **opts)  # the restarted job: only rank 0 restores
        _told_then_agree(rank, model, opt, state, data[5], "different iterations", (0, sd),
                         (1, sd))
        train(model, opt, data[5:9])
        assert state.iter == 9, (name, state.iter)
        assert params_equal_across_ranks(model), name
    # options that differ across ranks are told at the first step as well
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook("topk", ratio=0.01 if rank == 0 else 0.02, start_iter=0)
    model.register_comm_hook(state, hook)
    x, y = data[0]
    with pytest.raises(ValueError, match="options or start_iter"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    mark_ok(out_dir, rank)


def test_a_fresh_job_where_one_rank_restores_alone_fails_on_every_rank_then_trains():
    run_ok(_restored_alone, 2)
