# SPDX-License-Identifier: Apache-2.0
"""hook("auto"): the choice logic on recorded measurements, option checks, and 2-rank DDP runs
(the trial schedule, identical choices on every rank, training, checkpoints and pickling)."""
import json
import os
import pickle
import types

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402
from gradcomp.torch._auto import choose  # noqa: E402

from ddp_util import (Net, assert_resumed_equals_straight, load_checkpoint, make_data,  # noqa: E402
                      mark_ok, params_equal_across_ranks, run, run_ok, save_checkpoint, tmpdir,
                      train, train_losses, training_steps)

CANDS = ["allreduce", "fp16", "powersgd"]


# ---- the choice on recorded measurements --------------------------------------------------------
def test_choose_picks_cheapest_unless_a_more_faithful_one_is_within_margin():
    # recorded at 1 Gbit/s (a 24 MB bucket: compression wins) and for a small bucket on a fast
    # link (everything costs the same: the plain average stays)
    costs = {0: {"allreduce": 0.300, "fp16": 0.180, "powersgd": 0.060},
             1: {"allreduce": 0.0100, "fp16": 0.0103, "powersgd": 0.0098},
             2: {"allreduce": 0.050, "fp16": 0.030, "powersgd": 0.029}}
    assert choose(costs, CANDS) == {0: "powersgd", 1: "allreduce", 2: "fp16"}
    assert choose(costs, CANDS, margin=0.0) == {0: "powersgd", 1: "powersgd", 2: "powersgd"}
    assert choose(costs, CANDS, margin=10.0) == {0: "allreduce", 1: "allreduce", 2: "allreduce"}
    # a candidate without a measurement is not eligible; none at all is an error
    assert choose({3: {"allreduce": None, "fp16": 0.2, "powersgd": float("nan")}}, CANDS) == \
        {3: "fp16"}
    with pytest.raises(ValueError, match="bucket 4"):
        choose({4: {"allreduce": None}}, CANDS)
    # the step rule, a 0.4 s step: bucket 1 (a quarter of the elements) would save 0.2 ms with
    # PowerSGD, less than 5% of its 0.1 s share, so the plain average stays; bucket 2 saves 20 ms
    # with fp16, more than that, and PowerSGD 1 ms more than fp16, less: fp16
    shares = {0: 0.5, 1: 0.25, 2: 0.25}
    assert choose(costs, CANDS, step_margin=0.05, step_s=0.4, shares=shares) == \
        {0: "powersgd", 1: "allreduce", 2: "fp16"}
    # 70%: only bucket 0's fp16 (0.12 s less than the plain average, 0.12 s more than
    # PowerSGD) is within 0.7 x 0.2 s of the cheapest
    assert choose(costs, CANDS, step_margin=0.7, step_s=0.4, shares=shares) == \
        {0: "fp16", 1: "allreduce", 2: "allreduce"}
    # without a step time (or the sizes) only the bucket rule
    assert choose(costs, CANDS, step_margin=0.5) == choose(costs, CANDS)
    assert choose(costs, CANDS, step_margin=0.5, step_s=0.4) == choose(costs, CANDS)


def test_a_candidates_cost_is_per_step_the_least_over_the_ranks():
    """Per measured step the rank that started last (the least time: the others also count their
    wait for it), then the median over the steps; -1 (no sample) is left out."""
    from gradcomp.torch._auto import _mean_cost, _skew_free_cost

    # 3 ranks, 2 steps of a bucket whose exchange takes 5 ms: at step 0 rank 0 waited 40 ms for
    # rank 2, at step 1 rank 1 waited 60 ms for rank 2
    s = torch.tensor([[0.045, 0.008], [0.006, 0.065], [0.005, 0.005]])
    assert _skew_free_cost(s) == pytest.approx(0.005)
    # the earlier rule: the mean of the ranks' medians, 9.5x the exchange here
    assert _mean_cost(s) == pytest.approx((0.0265 + 0.0355 + 0.005) / 3)
    holes = torch.tensor([[-1.0, 0.010, -1.0], [0.020, 0.030, -1.0]])
    assert _skew_free_cost(holes) == pytest.approx(0.015)  # median of 0.020 and 0.010
    assert _skew_free_cost(torch.full((2, 3), -1.0)) is None
    assert _mean_cost(torch.full((2, 3), -1.0)) is None


def _gather_rows(rank, world, out_dir):
    from gradcomp.torch._auto import AutoState

    state = AutoState(None, candidates=["allreduce"])
    mine = torch.tensor([rank + 0.1, -1.0, 1e-3 * (rank + 1), 3.0 ** -rank])
    every = state._gather_ranks(mine)
    torch.save(every, os.path.join(out_dir, f"rows_{rank}.pt"))
    state.close()
    mark_ok(out_dir, rank)


def test_every_rank_gets_every_ranks_row():
    d = tmpdir()
    run(_gather_rows, 3, d)
    assert all(os.path.exists(os.path.join(d, f"ok_{r}")) for r in range(3))
    got = [torch.load(os.path.join(d, f"rows_{r}.pt")) for r in range(3)]
    assert all(torch.equal(g, got[0]) for g in got), "the ranks hold different matrices"
    want = torch.tensor([[r + 0.1, -1.0, 1e-3 * (r + 1), 3.0 ** -r] for r in range(3)])
    assert got[0].shape == (3, 4) and torch.allclose(got[0], want, rtol=1e-6, atol=0), got[0]


class _Stats:
    """A plan run's timings as the hook's sampler reads them."""

    def __init__(self, s):
        self.local_seconds, self.comm_seconds = s / 4, 3 * s / 4


def _drive_trial(monkeypatch, state, cost, step, build=None, slow=None):
    """Runs `state`'s schedule (bucket 0 of 1000 elements) from iteration 0 to one step past its
    trial, on a clock the test drives: each iteration moves it by `step` (seconds, or a dict by
    candidate, plain DDP's steps as "allreduce"), a candidate's first trial step (its plans'
    build, not measured) by `build` where given. A measured step reports cost[name] for the
    bucket, or slow[(name, k)] for that candidate's k-th measured step (1-based)."""
    from gradcomp.torch import _auto

    clock = [0.0]
    monkeypatch.setattr(_auto, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    state._numel = {0: 1000}
    seen = {}
    for it in range(1 + len(state.candidates) * state.trial_steps + 1):
        state._new_step(it)
        phase, name, measured = state.phase(it)
        if build is not None and phase == "trial" and not measured:
            clock[0] += build
        else:
            clock[0] += step[name or "allreduce"] if isinstance(step, dict) else step
        samples = []
        if measured:
            seen[name] = seen.get(name, 0) + 1
            c = (slow or {}).get((name, seen[name]), cost[name])
            samples = [state._sampler(name)(0, it, _Stats(c))]
        state._close_step(True, samples)


def test_a_saving_below_step_margin_of_the_step_keeps_the_more_faithful_candidate(monkeypatch):
    """A trial like the ViT's at 40 Gbit/s without added latency (2 ranks), where the steps with
    fp16 ran slower than plain DDP's: here fp16 costs its one bucket 2 ms less than the plain
    average (17% of the bucket's cost, under 3% of a 75 ms step). The trial's step time (from one
    iteration's first bucket to the next one's) scales step_margin: the plain average stays; a
    saving of 10% of the step still switches; with step_margin=0 the bucket rule alone decides."""
    for saving, step_margin, want in ((0.002, 0.05, "allreduce"), (0.0075, 0.05, "fp16"),
                                      (0.002, 0.0, "fp16")):
        state, _ = gt.hook("auto", candidates=["allreduce", "fp16"], trial_steps=2,
                           start_iter=1, step_margin=step_margin)
        cost = {"allreduce": 0.012, "fp16": 0.012 - saving}
        # a candidate's first trial step builds its plans (here 1 s): not a step time
        _drive_trial(monkeypatch, state, cost, step=0.075, build=1.0)
        assert [t["iter"] for t in state.trials] == [5]
        assert state.trials[0]["step_seconds"] == pytest.approx(0.075)
        assert state.choices == {0: want}, (saving, step_margin, state.trials)


def test_step_margin_scales_by_the_fastest_candidates_step_not_the_trials_mean(monkeypatch):
    """The ViT's trial on 4 ranks at 100 Mbit/s, in small: plain DDP's and fp16's steps take
    2.5-4x the compressed ones (0.8 and 0.5 s against 0.2 s), quant costs the bucket 70 ms and
    PowerSGD 53 ms. The saving (17 ms) is more than 5% of the step the choice will run (the
    fastest candidate's, 0.2 s: 10 ms), so PowerSGD is taken; 5% of the median of the trial's
    steps (0.36 s: 18 ms) would have kept quant, the rule before (``_fastest_step=False``),
    which the timed steps showed slower."""
    cands = ["allreduce", "fp16", "quant", "powersgd"]
    cost = {"allreduce": 0.60, "fp16": 0.30, "quant": 0.070, "powersgd": 0.053}
    step = {"allreduce": 0.8, "fp16": 0.5, "quant": 0.22, "powersgd": 0.2}
    for fastest, want in ((True, "powersgd"), (False, "quant")):
        state, _ = gt.hook("auto", candidates=cands, trial_steps=2, start_iter=1)
        state._fastest_step = fastest
        _drive_trial(monkeypatch, state, cost, step=step, build=1.0)
        assert [t["iter"] for t in state.trials] == [9]
        t = state.trials[0]
        assert t["candidate_step_seconds"] == pytest.approx(step), t
        assert t["step_seconds"] == pytest.approx(0.2 if fastest else (0.5 + 0.22) / 2), t
        assert state.choices == {0: want}, (fastest, t)


def test_one_slow_step_does_not_decide_the_trial(monkeypatch):
    """By default each candidate runs 4 steps: its plans' build, then 3 measured, whose median a
    single step slowed by a busy machine does not move. PowerSGD costs the bucket 53 ms and quant
    70 ms, but one of PowerSGD's measured steps took 200 ms: with 3 measured steps PowerSGD is
    still taken; with 2 (trial_steps=3, the default before) their median is the mean, 127 ms,
    and quant would be."""
    cands = ["quant", "powersgd"]
    cost = {"quant": 0.070, "powersgd": 0.053}
    assert gt.hook("auto")[0].trial_steps == 4
    for steps, want in ((None, "powersgd"), (3, "quant")):
        opts = {} if steps is None else {"trial_steps": steps}
        state, _ = gt.hook("auto", candidates=cands, start_iter=1, **opts)
        # the busy machine's step: PowerSGD's first measured one
        _drive_trial(monkeypatch, state, cost, step=0.3, slow={("powersgd", 1): 0.200})
        assert len(state.trials) == 1
        assert state.choices == {0: want}, (steps, state.trials)


def test_step_scale_from_the_ranks_step_times():
    """Per candidate the mean over the ranks that measured its steps, then the least over the
    candidates; a candidate without steps does not count; none at all falls back to the whole
    trial's (the earlier rule), and with nothing measured the scale is unknown."""
    from gradcomp.torch._auto import _step_scale

    per = torch.tensor([[0.8, 0.30, 0.21], [0.9, 0.26, -1.0], [0.7, 0.28, 0.25]])
    whole = torch.tensor([0.4, 0.5, -1.0])
    assert _step_scale(per, whole) == pytest.approx(0.23)  # (0.21 + 0.25) / 2
    assert _step_scale(per, whole, fastest=False) == pytest.approx(0.45)
    none = torch.full((3, 3), -1.0)
    assert _step_scale(none, whole) == pytest.approx(0.45)
    assert _step_scale(none, torch.full((3,), -1.0)) is None
    assert _step_scale(torch.empty(2, 0), torch.tensor([0.3, 0.5])) == pytest.approx(0.4)


def test_schedule_plain_then_trial_then_chosen():
    state, _ = gt.hook("auto", trial_steps=2, start_iter=1)
    assert state.candidates == ["allreduce", "fp16", "quant", "powersgd"]  # the defaults
    got = [state.phase(i) for i in range(10)]
    assert got == [("plain", "allreduce", False),
                   ("trial", "allreduce", False), ("trial", "allreduce", True),
                   ("trial", "fp16", False), ("trial", "fp16", True),
                   ("trial", "quant", False), ("trial", "quant", True),
                   ("trial", "powersgd", False), ("trial", "powersgd", True),
                   ("chosen", None, False)]


def test_decisions_and_rechecks_from_recorded_costs():
    """The schedule run step by step without a process group, fed recorded per-bucket costs: a
    decision after each trial, a recheck every recheck_every iterations, the state of a
    compressor a bucket leaves dropped."""
    state, _ = gt.hook("auto", trial_steps=2, start_iter=1, recheck_every=10)
    link = {"allreduce": 0.30, "fp16": 0.18, "quant": 0.09, "powersgd": 0.06}  # a slow link

    for it in range(30):
        if it == 12:
            link = {"allreduce": 0.010, "fp16": 0.0103, "quant": 0.0105,
                    "powersgd": 0.0098}  # a fast link
        state._new_step(it)
        phase, name, measured = state.phase(it)
        samples = [state._sampler(name)(idx, it, _Stats(link[name] * (1 + idx)))
                   for idx in (0, 1)] if measured else []
        state._close_step(True, samples)  # an applied step files its samples
        state.subs["powersgd"].buckets[0] = object()  # as if bucket 0 had PowerSGD state
    assert [t["iter"] for t in state.trials] == [9, 27]  # trials at 1-8 and 19-26
    assert state.trials[0]["choices"] == {0: "powersgd", 1: "powersgd"}
    assert state.trials[1]["choices"] == {0: "allreduce", 1: "allreduce"}
    assert state.trials[1]["costs"][1]["fp16"] == pytest.approx(0.0206)
    state._decide(30)  # nothing measured since: no buckets, no choices
    assert state.choices == {} and 0 not in state.subs["powersgd"].buckets


@pytest.mark.parametrize("bad", [
    dict(candidates=["allreduce", "bogus"]), dict(candidates=[]), dict(candidates="fp16"),
    dict(candidates=["fp16", "fp16"]), dict(min_rank=0), dict(max_density=0.0),
    dict(max_density=1.5), dict(trial_steps=1), dict(recheck_every=-1),
    dict(recheck_every=5), dict(margin=-0.1), dict(margin=float("inf")), dict(start_iter=-1),
    dict(step_margin=-0.01), dict(step_margin=1.0), dict(step_margin=True),
    dict(step_margin="0.05"),
    dict(unknown_option=1)])
def test_bad_options_raise_value_error(bad):
    with pytest.raises((ValueError, TypeError)):
        gt.hook("auto", **bad)


# ---- 2-rank DDP ---------------------------------------------------------------------------------
def _auto_run(rank, world, out_dir, phase, cands, big=False):
    # big: Linear(64, 700) -> Linear(700, 700) -> Linear(700, 8), whose single initial DDP bucket
    # is regrouped into two after the first iteration
    dims = dict(d_in=64, d_hidden=700, d_out=8) if big else {}
    data = make_data(rank, 30, **{k: v for k, v in dims.items() if k != "d_hidden"})
    torch.manual_seed(0)
    model = DDP(Net(**dims))
    state, hook = gt.hook("auto", model=model, candidates=cands, trial_steps=2, recheck_every=12)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    path = os.path.join(out_dir, f"auto_{rank}.pt")
    if phase == "resume":
        load_checkpoint(path, model, opt, state)
        steps = range(15, 30)
    else:
        steps = range(0, 15) if phase == "first" else range(0, 30)
    losses = train_losses(model, opt, [data[i] for i in steps])
    same = params_equal_across_ranks(model)
    if phase == "first":
        save_checkpoint(path, model, opt, state)
        s2 = pickle.loads(pickle.dumps(state))
        assert s2.state_dict()["choices"] == state.state_dict()["choices"]
    torch.save(model.module.state_dict(), os.path.join(out_dir, f"final_{phase}_{rank}.pt"))
    with open(os.path.join(out_dir, f"{phase}_{rank}.json"), "w") as f:
        json.dump({"trials": state.trials, "choices": state.choices, "same": same,
                   "losses": losses, "iter": state.iter,
                   "history": [h["buckets"] for h in state.history],
                   "comm": [h["comm_seconds"] for h in state.history]}, f)


def test_auto_trains_decides_the_same_on_every_rank_and_restores():
    d = tmpdir()
    run(_auto_run, 2, d, "straight", CANDS)
    r = [json.load(open(os.path.join(d, f"straight_{k}.json"))) for k in range(2)]
    for x in r:
        assert x["same"] and x["iter"] == 30
        assert sum(x["losses"][-5:]) < 0.7 * sum(x["losses"][:5]), x["losses"]  # trains
        # start_iter 2, 3 candidates x 2 steps: decided at 8; recheck at 8 + 12 = 20, decided 26
        assert [t["iter"] for t in x["trials"]] == [8, 26]
        for t in x["trials"]:
            assert t["choices"], t
            for costs in t["costs"].values():
                assert all(v is not None and v > 0 for v in costs.values()), costs
            # every candidate's measured step, and step_margin's scale the fastest of them
            per = t["candidate_step_seconds"]
            assert sorted(per) == sorted(CANDS) and all(v > 0 for v in per.values()), t
            assert t["step_seconds"] == pytest.approx(min(per.values())), t
        assert all(b >= 1 for b in x["history"]) and all(c > 0 for c in x["comm"])
    assert r[0]["trials"] == r[1]["trials"]  # consensus: the same costs and choices everywhere


def test_auto_checkpoint_resumes_bitwise():
    # one candidate, so that the choice (timed) is the same in both runs: PowerSGD's error and Q
    # travel in the checkpoint taken after the first decision and before the recheck
    d = tmpdir()
    run(_auto_run, 2, d, "straight", ["powersgd"])
    run(_auto_run, 2, d, "first", ["powersgd"])
    run(_auto_run, 2, d, "resume", ["powersgd"])
    r = json.load(open(os.path.join(d, "resume_0.json")))
    assert r["choices"] and set(r["choices"].values()) == {"powersgd"}
    assert_resumed_equals_straight(d, 2, "auto")


def test_auto_checkpoint_resumes_bitwise_on_a_model_whose_buckets_ddp_regroups():
    # the restored job's first iteration runs DDP's initial bucket, which holds the parameters
    # of both saved ones
    d = tmpdir()
    for phase in ("straight", "first", "resume"):
        run(_auto_run, 2, d, phase, ["topk"], True)
    r = json.load(open(os.path.join(d, "resume_0.json")))
    assert len(r["choices"]) >= 2 and set(r["choices"].values()) == {"topk"}, r["choices"]
    assert_resumed_equals_straight(d, 2, "auto")


# ---- the timeline from the hook's own records ---------------------------------------------------
def _timeline_run(rank, world, out_dir):
    data = make_data(rank, 10)
    out = {}
    for name, opts in (("powersgd", dict(rank=2)), ("topk", dict(ratio=0.1)),
                       ("auto", dict(trial_steps=2))):
        torch.manual_seed(0)
        model = DDP(Net(d_hidden=600), bucket_cap_mb=0.5)  # 1.5 MB: several buckets
        state, hook = gt.hook(name, **opts)
        model.register_comm_hook(state, hook)
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
        out[name] = {"rows": gt.timeline(state), "text": gt.format_timeline(gt.timeline(state)),
                     "iter4": gt.timeline(state, 4)}
        with pytest.raises(ValueError, match="no record"):
            gt.timeline(state, 10**6)
    if rank == 0:
        with open(os.path.join(out_dir, "timeline.json"), "w") as f:
            json.dump(out, f)


def test_timeline_shows_each_buckets_phases_in_order():
    d = tmpdir()
    run(_timeline_run, 2, d)
    out = json.load(open(os.path.join(d, "timeline.json")))
    for name, r in out.items():
        rows = r["rows"]
        assert len(rows) >= 2, (name, rows)  # several buckets, one row each
        assert {x["iter"] for x in rows} == {9} and {x["iter"] for x in r["iter4"]} == {4}
        for x in rows:
            ph = x["phases"]
            assert ph, x
            if x["compressor"] != "allreduce":  # a plan run: begin, local work, collectives
                assert ph[0][0] == "begin" and any(w == "local" for w, _, _ in ph)
                assert any(w not in ("begin", "local") for w, _, _ in ph)
                assert x["queued_ms"] <= x["started_ms"] + 1e-6
            for (_, a, b), nxt in zip(ph, ph[1:] + [None]):
                assert 0 <= a <= b + 1e-6
                if nxt is not None:
                    assert b <= nxt[1] + 1e-6  # phases in order, no overlap
        assert len(r["text"].splitlines()) == len(rows) + 1
    # auto chose per bucket after its trial: the rows name the candidate that ran
    assert {x["compressor"] for x in out["auto"]["rows"]} <= {"allreduce", "fp16", "powersgd"}


# ---- pipelining: the next bucket's compression overlaps the current transfer --------------------
def _prefetch_order(rank, world, out_dir):
    import threading

    import torch.distributed as dist

    from gradcomp import _C
    from gradcomp.torch._worker import Worker

    w = Worker(dist.new_group(ranks=[0]), pipeline=True)
    gate = threading.Event()

    class Blocker:  # holds the worker until A and B are queued
        def next(self):
            gate.wait(10)
            return None

    class Failing:
        def next(self):
            raise ValueError("bad bucket B")

    a = torch.ones(1000)
    plan_a = _C.make_plan("allreduce", a.numel(), "float32", 1)
    plan_a.begin(a, 0)
    f0 = w.submit(Blocker(), lambda: None)
    fa = w.submit(plan_a, lambda: a)
    fb = w.submit(Failing(), lambda: None)
    gate.set()
    f0.wait()
    assert torch.equal(fa.wait(), torch.ones(1000))  # A is unaffected by B's error
    with pytest.raises(ValueError, match="bad bucket B"):
        fb.wait()
    assert w.prefetched == 1  # B's first phase ran while A's collective was in flight
    w.close()


def test_prefetched_bucket_keeps_its_own_error():
    run(_prefetch_order, 1, tmpdir())


def _pipeline_bitwise(rank, world, out_dir):
    data = make_data(rank, 12)
    out = {}
    for name, opts in (("topk", dict(ratio=0.05)), ("onebit", {}), ("powersgd", dict(rank=2))):
        for pipeline in (True, False):
            torch.manual_seed(0)
            model = DDP(Net(d_hidden=600), bucket_cap_mb=0.5)  # several buckets
            state, hook = gt.hook(name, pipeline=pipeline, **opts)
            model.register_comm_hook(state, hook)
            train(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), data)
            out[(name, pipeline)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert state._worker.pipeline is pipeline
        assert torch.equal(out[(name, True)], out[(name, False)]), name
    with pytest.raises(ValueError, match="pipeline"):
        gt.hook("topk", pipeline="yes")


def test_pipelined_hooks_give_the_serial_bits():
    run(_pipeline_bitwise, 2, tmpdir())


def test_quant_is_a_candidate_with_its_bits_bound():
    state, _ = gt.hook("auto", candidates=["quant", "allreduce"], min_bits=2)
    assert state.candidates == ["allreduce", "quant"]  # in faithfulness order
    assert state.subs["quant"].options == {"bits": 2}
    for bad in (3, 1, 16, 4.0, True):
        with pytest.raises(ValueError, match="min_bits"):
            gt.hook("auto", candidates=["quant"], min_bits=bad)


def test_route_candidates_where_gloo_has_more_than_two_ranks():
    """Where the routes are candidates of their own (gloo, more than 2 ranks: _gather=True), each
    follows its flat candidate, the gather route first, and runs its family by that route; a
    checkpoint that chose a route loads where the route is no candidate as the flat family."""
    from gradcomp.torch._auto import AutoState

    routed = AutoState(None, _gather=True, _lazy=True)
    assert routed.candidates == ["allreduce", "fp16", "fp16/gather", "fp16/allreduce", "quant",
                                 "quant/gather", "powersgd"]
    assert routed.subs["fp16/allreduce"].compressor == "fp16"
    assert routed.subs["fp16/allreduce"].options["route"] == "allreduce"
    assert routed.subs["fp16/gather"].options["route"] == "gather"
    assert routed.subs["quant/gather"].options["route"] == "gather"
    assert routed.options["candidates"] == ["allreduce", "fp16", "quant", "powersgd"]
    routed.choices = {0: "fp16/allreduce", 1: "quant/gather", 2: "fp16/gather"}
    flat = AutoState(None, _gather=False, _lazy=True)
    assert flat.candidates == ["allreduce", "fp16", "quant", "powersgd"]
    flat.load_state_dict(routed.state_dict())
    assert flat.choices == {0: "fp16", 1: "quant", 2: "fp16"}
    # and back: the routes' candidates exist again, the flat choices stand
    back = AutoState(None, _gather=True, _lazy=True)
    back.load_state_dict(flat.state_dict())
    assert back.choices == flat.choices and back.candidates == routed.candidates
    for s in (routed, flat, back):
        s.close()


def test_fp8_is_a_candidate_between_fp16_and_quant():
    state, _ = gt.hook("auto", candidates=["quant", "fp8", "allreduce", "fp16"])
    assert state.candidates == ["allreduce", "fp16", "fp8", "quant"]  # in faithfulness order
    assert state.subs["fp8"].compressor == "fp8" and state.subs["fp8"].options == {}


@pytest.mark.parametrize("cands,world", [(["allreduce", "quant"], 2), (["allreduce", "fp8"], 2),
                                         (["allreduce", "fp8"], 3), (["allreduce", "quant"], 3),
                                         (["allreduce", "fp16"], 3)])
def test_auto_with_the_quant_or_fp8_candidate_trains_and_decides_alike(cands, world):
    """quant (stateful) and fp8 (stateless) among the candidates, each with a gather route of its
    own on more than 2 ranks of gloo (the candidates "quant/gather", "fp8/gather"), and fp16 with
    its gather and ring routes ("fp16/gather", "fp16/allreduce"): every rank measures every
    route, decides the same and ends with the same parameters."""
    d = tmpdir()
    run(_auto_run, world, d, "straight", cands)
    want = set(cands) | ({f"{c}/gather" for c in cands if c in ("fp8", "quant", "fp16")}
                         | {f"{c}/allreduce" for c in cands if c == "fp16"} if world > 2
                         else set())
    r = [json.load(open(os.path.join(d, f"straight_{k}.json"))) for k in range(world)]
    for x in r:
        assert x["same"] and x["iter"] == 30
        assert sum(x["losses"][-5:]) < 0.7 * sum(x["losses"][:5]), x["losses"]
        assert x["trials"], x
        for t in x["trials"]:
            for costs in t["costs"].values():
                assert set(costs) == want and all(v > 0 for v in costs.values()), costs
    assert all(x["trials"] == r[0]["trials"] for x in r)


def _native_vs_plain(rank, world, out_dir):
    data = make_data(rank, 6)
    grads = {}
    for kind in ("plain", "auto"):
        torch.manual_seed(0)
        model = DDP(Net())
        if kind == "auto":
            state, hook = gt.hook("auto", model=model, candidates=["allreduce"], trial_steps=2)
            model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        grads[kind] = [[p.grad.detach().clone() for p in model.parameters()]
                       for _ in training_steps(model, opt, data)]
        if kind == "auto":
            state.close()
    torch.save(grads, os.path.join(out_dir, f"native_{rank}.pt"))


def test_auto_allreduce_is_ddps_own_average_bit_for_bit():
    # On 3 ranks, where x / 3 and x * (1/3) differ in the last bit: the average auto's allreduce
    # candidate gives (in its plain steps, its trial and once chosen) is plain DDP's, whose
    # reducer scales each gradient by the reciprocal before the sum, not PyTorch's
    # allreduce_hook's (a division), at every step and every parameter
    d = tmpdir()
    run(_native_vs_plain, 3, d)
    for r in range(3):
        g = torch.load(os.path.join(d, f"native_{r}.pt"))
        assert len(g["auto"]) == len(g["plain"]) == 6
        for step, (a, p) in enumerate(zip(g["auto"], g["plain"])):
            for i, (ga, gp) in enumerate(zip(a, p)):
                assert torch.equal(ga, gp), (r, step, i, (ga - gp).abs().max())
    # the test can tell the two scalings apart: on this data they differ somewhere
    x = torch.randn(10000, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(x / 3, x * (1.0 / 3))


def _lend_gather_state(rank, world, out_dir):
    """auto with quant alone (so "quant" and "quant/gather") decides on 3 ranks; its state then
    loads where the gather route is no candidate (another backend's job: _gather=False), and
    that state back where it is."""
    from gradcomp.torch._auto import AutoState

    data = make_data(rank, 12)
    torch.manual_seed(0)
    model = DDP(Net())
    state, hook = gt.hook("auto", model=model, candidates=["quant"], trial_steps=2)
    assert state.candidates == ["quant", "quant/gather"], state.candidates
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    train(model, opt, data)  # start_iter 2, 2 candidates x 2 steps: decided at 6
    sd = state.state_dict()
    assert len(set(sd["choices"].values())) == 1, sd["choices"]  # (Net: one bucket)
    owner = next(iter(sd["choices"].values()))
    other = "quant" if owner == "quant/gather" else "quant/gather"
    assert not sd["subs"][other]["buckets"], "the unchosen route's state was kept"
    held = {k: v["state"] for k, v in sd["subs"][owner]["buckets"].items()}
    assert held and all(len(b) > 0 for b in held.values())
    # where quant has no gather route: quant holds what either route held
    flat = AutoState(None, model=model, candidates=["quant"], trial_steps=2, _gather=False)
    assert flat.candidates == ["quant"]
    flat.load_state_dict(sd)
    got = {k: v["state"] for k, v in flat.subs["quant"].state_dict()["buckets"].items()}
    assert got == held, "the gather route's worker error was dropped"
    assert set(flat.choices.values()) == {"quant"}
    # and back: the gather route is lent quant's state
    back = AutoState(None, model=model, candidates=["quant"], trial_steps=2, _gather=True)
    back.load_state_dict(flat.state_dict())
    for n in ("quant", "quant/gather"):
        got = {k: v["state"] for k, v in back.subs[n].state_dict()["buckets"].items()}
        assert got == held, n
    for s in (state, flat, back):
        s.close()
    mark_ok(out_dir, rank)


def test_quants_gather_route_state_is_lent_both_ways_never_dropped():
    run_ok(_lend_gather_state, 3)
