# SPDX-License-Identifier: Apache-2.0
"""Mixed precision with the hooks: a step whose gradients overflow on one rank (what a loss
scaler produces now and then) is skipped by every rank and leaves no trace.

- The strongest check: a run in which rank 1's loss is multiplied by Inf at step s ends with the
  parameters and the hook's state (residuals, momenta, errors, Q, step counters) bitwise equal to
  a run in which step s never happened, for every stateful family, several buckets.
- on_nonfinite="raise": loss.backward() raises on every rank, and the same DDP model trains on.
- A real torch.amp.GradScaler run (torch 2.x on the CPU, fp16 autocast): an initial scale that
  overflows, the loss goes down, and the scaler's skipped steps are the hook's.
- Errors raised where the hook binds a bucket (a sparse gradient) reach the user from
  backward() and leave DDP usable.
"""
import os
import pickle

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (EmbedNet, Net, make_data, mark_ok, params_equal_across_ranks,  # noqa: E402
                      run, run_ok, tmpdir, training_steps)

FAMILIES = [
    ("topk", dict(ratio=0.05)),
    ("topk", dict(ratio=0.05, momentum=0.9, exchange="sizes")),
    ("randomk", dict(ratio=0.05, dense_below=1000)),
    ("onebit", dict()),
    ("onebit", dict(momentum=0.9)),
    ("quant", dict(bits=4)),  # on these 2 ranks: the one-round gather route, quant's default
    ("quant", dict(bits=4, route="two_phase")),
    ("powersgd", dict(rank=2)),
    # every bucket held until the step's last one (the after-backward structure): the skip and
    # the taking back of kept buckets must not depend on when the buckets run
    ("onebit", dict(overlap=False)),
    ("topk", dict(ratio=0.05, momentum=0.9, overlap=False)),
]
STEPS, BAD = 8, 4  # BAD > start_iter (2): the step is a compressed one


def _train(rank, model, opt, state, data, bad_step=None, where="loss"):
    """The loop a GradScaler runs: after backward, a step whose averaged gradients are not all
    finite is skipped (no optimizer step). Returns the steps skipped. The overflow on rank 1 at
    `bad_step`: in the loss (every gradient non-finite) or, with where="layer", in the first
    layer's weight gradient alone (as an fp16 overflow deep in the network is: the buckets of
    the later layers are finite and kept, and must take their step back)."""
    skipped = []
    poison = []
    if where == "layer":
        fc1 = model.module.fc1.weight
        poison.append(fc1.register_hook(
            lambda g: g * float("inf") if poison[-1] and rank == 1 else g))
    for s, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if where == "layer":
            poison.append(s == bad_step)
        elif s == bad_step and rank == 1:
            loss = loss * float("inf")  # an overflow on one rank only
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if finite:
            opt.step()
        else:
            skipped.append(s)
            if where == "loss":  # every rank sees the whole step non-finite: every bucket NaN
                assert all(torch.isnan(p.grad).all() for p in model.parameters())
            else:  # fc1's bucket is NaN on every rank, the output layer's is finite
                assert torch.isnan(model.module.fc1.weight.grad).all()
                assert torch.isfinite(model.module.fc3.weight.grad).all()
    return skipped


def _overflow_step(rank, world, out_dir, name, opts, where="loss"):
    data = make_data(rank, STEPS)
    results = {}
    for run_kind in ("overflow", "never"):
        torch.manual_seed(0)
        # a small bucket cap: several buckets, each its own plan and state
        model = DDP(Net(d_hidden=600), bucket_cap_mb=0.01)
        state, hook = gt.hook(name, model=model, **opts)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if run_kind == "overflow":
            skipped = _train(rank, model, opt, state, data, bad_step=BAD, where=where)
            assert skipped == [BAD], skipped
            assert state.skipped_steps == 1
            assert state.iter == STEPS - 1  # the skipped step did not count
        else:
            skipped = _train(rank, model, opt, state, data[:BAD] + data[BAD + 1:])
            assert skipped == [] and state.skipped_steps == 0
        assert len(state.buckets) >= 2, "the test needs several buckets"
        assert params_equal_across_ranks(model)
        results[run_kind] = ([p.detach().clone() for p in model.parameters()], state.state_dict())
    (pa, sa), (pb, sb) = results["overflow"], results["never"]
    for a, b in zip(pa, pb):
        assert torch.equal(a, b), f"{name}: parameters differ from the run without the step"
    assert sa["iter"] == sb["iter"]
    assert sa["buckets"].keys() == sb["buckets"].keys()
    for i in sa["buckets"]:
        assert sa["buckets"][i]["state"] == sb["buckets"][i]["state"], \
            f"{name}: bucket {i}'s compression state differs from the run without the step"
    mark_ok(out_dir, rank)


@pytest.mark.parametrize("name,opts", FAMILIES, ids=[f"{n}-{i}" for i, (n, _) in
                                                    enumerate(FAMILIES)])
@pytest.mark.parametrize("where", ["loss", "layer"])
def test_overflow_step_leaves_no_trace(name, opts, where):
    run_ok(_overflow_step, 2, name, opts, where)


# on 3 ranks the families whose collectives are small fp32 allreduces sum them as one allgather
# in rank order (the driver's one-round route, counted by its own wire bytes): the overflow step
# must be skipped on every rank alike there too (plain allreduce is left out: it is the plain
# sum, Inf where a rank's gradient is Inf, as PyTorch's own allreduce, on either route)
@pytest.mark.parametrize("name,opts", [("powersgd", dict(rank=2)),
                                       ("randomk", dict(ratio=0.05, dense_below=1000))])
def test_overflow_step_leaves_no_trace_on_three_ranks(name, opts):
    run_ok(_overflow_step, 3, name, opts, "layer")


def _raise_policy(rank, world, out_dir):
    data = make_data(rank, 6)
    for name, opts in (("topk", dict(ratio=0.1)), ("onebit", {}), ("powersgd", dict(rank=2)),
                       ("randomk", dict(ratio=0.1, dense_below=100)), ("quant", {})):
        torch.manual_seed(0)
        model = DDP(Net())
        state, hook = gt.hook(name, start_iter=0, on_nonfinite="raise", **opts)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = data[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        before = pickle.dumps(state.state_dict())
        x, y = data[1]
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 0:
            loss = loss * float("inf")
        # raised on both ranks: rank 0 names its index, rank 1 says another rank's was bad
        with pytest.raises(ValueError, match="non-finite"):
            loss.backward()
        assert pickle.dumps(state.state_dict()) == before, name
        # DDP finished its step (the error was raised after it): the same model trains on
        for _ in training_steps(model, opt, data[2:]):
            assert all(torch.isfinite(p.grad).all() for p in model.parameters()), name
        assert params_equal_across_ranks(model)
    mark_ok(out_dir, rank)


def test_raise_policy_raises_on_every_rank_and_ddp_trains_on():
    run_ok(_raise_policy, 2)


def _sparse_gradient(rank, world, out_dir):
    torch.manual_seed(0)
    model = DDP(EmbedNet(sparse=True))
    state, hook = gt.hook("topk", ratio=0.1, start_iter=0)
    model.register_comm_hook(state, hook)
    idx = torch.randint(0, 50, (16,))
    for _ in range(2):  # the error each time, and DDP still usable for the next step
        with pytest.raises(ValueError, match="sparse=False"):
            model(idx).sum().backward()
    mark_ok(out_dir, rank)


def test_sparse_gradient_is_refused_with_advice_and_ddp_stays_usable():
    run_ok(_sparse_gradient, 2)


def _grad_scaler(rank, world, name, opts, out_dir):
    torch.manual_seed(0)
    data = make_data(rank, 60)
    model = DDP(Net(d_hidden=600), bucket_cap_mb=0.01)
    state, hook = gt.hook(name, model=model, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # fp16 autocast with an initial scale that overflows the fp16 activation gradients: the
    # first steps (8 here) are skipped as the scaler halves it, then it trains
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=1000)
    losses, scaler_skips = [], 0
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            scaler_skips += 1
        losses.append(loss.item())
    assert scaler_skips >= 1, "the initial scale did not overflow"
    assert state.skipped_steps == scaler_skips, (state.skipped_steps, scaler_skips)
    first = sum(losses[scaler_skips:scaler_skips + 5]) / 5
    last = sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert params_equal_across_ranks(model)
    with open(os.path.join(out_dir, f"ok_{rank}"), "w") as f:
        f.write(f"{scaler_skips} {first} {last}")


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler on the CPU needs torch 2.x")
@pytest.mark.parametrize("name,opts", [FAMILIES[0], FAMILIES[2], FAMILIES[3], FAMILIES[5], FAMILIES[6]],
                         ids=["topk", "randomk", "onebit", "quant", "powersgd"])
def test_grad_scaler_skips_match_the_hooks_and_training_goes_on(name, opts):
    out = tmpdir()
    run(_grad_scaler, 2, name, opts, out)
    assert sorted(os.listdir(out)) == ["ok_0", "ok_1"]


def _rebuilt_buckets(rank, world, out_dir):
    # DDP regroups this model's parameters when it rebuilds its buckets after the first
    # iteration: compression state made at iteration 0 (start_iter=0) no longer fits a bucket
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 700), torch.nn.Linear(700, 700),
                                    torch.nn.Linear(700, 8)))
    state, hook = gt.hook("topk", ratio=0.01, start_iter=0)
    model.register_comm_hook(state, hook)
    x = torch.randn(4, 64)
    model(x).sum().backward()  # iteration 0: one bucket, compressed
    msgs = []
    for _ in range(2):  # the same clear error each time, not DDP's internal assert
        with pytest.raises(RuntimeError) as err:
            model(x).sum().backward()
        msgs.append(str(err.value))
    assert all("start_iter" in m for m in msgs), msgs
    mark_ok(out_dir, rank)


def test_bucket_mismatch_error_reaches_the_user_and_ddp_stays_usable():
    run_ok(_rebuilt_buckets, 2)


def _auto_overflow(rank, world, out_dir, cands=("allreduce", "fp16", "powersgd"), bad=2,
                   counted=False, steps=3):
    torch.manual_seed(0)
    data = make_data(rank, 12)
    model = DDP(Net(d_hidden=600), bucket_cap_mb=0.01)
    opts = {} if steps is None else {"trial_steps": steps}  # None: auto's default
    state, hook = gt.hook("auto", model=model, candidates=cands, start_iter=1, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def samples():
        return sum(len(v) for v in state._samples.values())

    # iteration `bad` is a measured trial step (with 3 steps a candidate, 2: allreduce's; 5: the
    # second candidate's); the overflow there must leave no timing sample and not advance the
    # schedule; its retry (the same iteration) is measured as usual
    for s, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if s == bad and rank == 1:
            loss = loss * float("inf")
        if s == bad:
            assert state.phase(state.iter)[0] == "trial" and state.phase(state.iter)[2]
        if s == bad and world > 2 and "quant" in cands:
            assert state.phase(state.iter)[1:] == ("quant/gather", True), state.candidates
        before_iter, before_samples = state.iter, samples()
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if s == bad:
            assert not finite
            if counted:
                # a stateless candidate (fp16, fp8) has nothing to take back, so its steps are
                # not scanned (as plain allreduce's after the trial): the step counts, on every
                # rank alike, and the average's NaN is the optimizer's to skip
                assert state.iter == before_iter + 1
                continue
            assert state.iter == before_iter and samples() == before_samples
        else:
            assert finite
            assert state.iter == before_iter + 1
            if s == bad + 1 and not counted:
                assert samples() > before_samples, "the retry was not measured"
            opt.step()
    assert state.iter == len(data) - (0 if counted else 1)
    assert len(state.history) == len(data)  # every step the hook saw, the skipped one included
    assert state.trials, "no decision was made"
    # the step time the step rule scales by is measured (the gap over the skipped step is not)
    assert all(t["step_seconds"] and t["step_seconds"] > 0 for t in state.trials), state.trials
    # ... as the fastest candidate's step, each candidate's from its own measured steps only
    for t in state.trials:
        per = t["candidate_step_seconds"]
        assert per and all(v > 0 for v in per.values()), t
        assert t["step_seconds"] == pytest.approx(min(per.values())), t
    assert params_equal_across_ranks(model)
    mark_ok(out_dir, rank)


@pytest.mark.parametrize("cands,bad,counted,world,steps", [
    (("allreduce", "fp16", "powersgd"), 2, False, 2, 3),
    (("allreduce", "fp8"), 5, True, 2, 3),
    (("allreduce", "fp16"), 5, True, 2, 3),
    # on 3 ranks quant's gather route is a candidate of its own ("quant/gather", iterations
    # 7-9): stateful, so its overflow step is skipped on every rank and taken back
    (("allreduce", "quant"), 8, False, 3, 3),
    # the default trial (4 steps a candidate: iterations 1-4 allreduce's, 5-8 PowerSGD's, each
    # candidate's first one building its plans): PowerSGD's first measured step overflows
    (("allreduce", "powersgd"), 6, False, 2, None)])
def test_auto_hook_overflow_step_leaves_no_sample_and_keeps_the_schedule(cands, bad, counted,
                                                                         world, steps):
    run_ok(_auto_overflow, world, cands, bad, counted, steps)
