# SPDX-License-Identifier: Apache-2.0
"""1-bit Adam (gradcomp.torch.OneBitAdam with hook("onebit", adam=opt)): the update against a
scalar reference in both phases, AdamW during the warm-up, the pair on 1-4 gloo ranks (ranks
agree bitwise, the variance stays frozen, the wire bytes drop after the freeze), a checkpoint
round trip, and the argument checks."""
import copy
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomp.torch as gt  # noqa: E402
from ddp_util import (Net, assert_resumed_equals_straight, load_checkpoint, make_data,  # noqa: E402
                      mark_ok, params_equal_across_ranks, run_ok, save_checkpoint, train)
from gradcomp.torch.onebit_adam import OneBitAdam  # noqa: E402


def reference(x0, grads, lr, b1, b2, eps, wd, t0, var_floor=0.01):
    """1-bit Adam's parameter trajectory in float64 from the gradients each step hands the
    optimizer (steps 1..t0: the averaged gradient; later: the hook's averaged momentum u of the
    gradients divided by the frozen denominator d), written from the algorithm, not from the
    optimizer's code: after the freeze the step is Adam's m_t / d with m_t = b1^k m_T0 plus the
    momentum of the gradients since the freeze, bias-corrected by the global step t."""
    x = np.asarray(x0, np.float64).copy()
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        x = x * (1 - lr * wd)
        if t <= t0:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
            x = x - lr * mh / (np.sqrt(vh) + eps)
        else:  # g = u, the momentum of gradient / d since the freeze; Adam's m carried on
            if t == t0 + 1:
                m0 = m.copy()
                vh0 = v / (1 - b2 ** t0)
                mean = vh0.mean() if vh0.size else 0.0
                d = np.sqrt(np.maximum(vh0, var_floor * mean)) + eps
            k = t - t0
            m_over_d = b1 ** k * m0 / d + (1 - b1) * g  # = m_t / d, m_t = b1^k m0 + (1-b1) sum
            x = x - lr * m_over_d / (1 - b1 ** t)
        out.append(x.copy())
    return out, v


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_update_matches_the_scalar_reference_in_both_phases(n):
    rng = np.random.default_rng(n)
    x0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * (1 + t) for t in range(9)]
    if n > 1:  # one coordinate silent during the warm-up (a dead unit that wakes up later)
        for g in grads[:4]:
            g[n // 2] = 0.0
    lr, b1, b2, eps, wd, t0 = 1e-2, 0.9, 0.99, 1e-8, 0.05, 4
    p = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    opt = OneBitAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=t0)
    want, v_frozen = reference(x0, grads, lr, b1, b2, eps, wd, t0)
    for t, g in enumerate(grads):
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        np.testing.assert_allclose(p.detach().numpy(), want[t], rtol=2e-5, atol=1e-6,
                                   err_msg=f"step {t + 1}")
    if n:  # the second moment stopped moving at the freeze; the hook's 1 / d comes from it
        np.testing.assert_allclose(opt.state[p]["exp_avg_sq"].numpy(), v_frozen, rtol=1e-5)
        vh = v_frozen / (1 - b2 ** t0)
        d = np.sqrt(np.maximum(vh, 0.01 * vh.mean())) + eps
        np.testing.assert_allclose(opt.inverse_denominator(p).numpy(), 1 / d, rtol=1e-5)
        # a coordinate whose gradient was zero in the warm-up steps at most 10x the typical one
        assert np.all(1 / d <= 1 / np.sqrt(0.01 * vh.mean()) * (1 + 1e-5))


def test_warm_up_is_adamw():
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    oa = OneBitAdam(a.parameters(), lr=3e-3, weight_decay=0.1, freeze_step=6)
    ob = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.1)
    for x, y in make_data(0, 6):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


def test_arguments_are_checked():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for kw in (dict(lr=0.0), dict(betas=(1.0, 0.9)), dict(eps=0.0), dict(weight_decay=-1.0),
               dict(freeze_step=0), dict(freeze_step=2.5), dict(freeze_step=True),
               dict(var_floor=-0.1), dict(var_floor=2.0), dict(lr="1e-3"), dict(lr=True),
               dict(betas=(0.9,)), dict(betas=0.9), dict(betas=("a", "b")), dict(eps="x"),
               dict(weight_decay=None), dict(var_floor="0.1")):
        with pytest.raises(ValueError) as e:  # a ValueError naming the argument, never a raw
            OneBitAdam(p, **kw)               # unpacking or comparison error
        assert list(kw)[0] in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="share betas"):
        OneBitAdam([{"params": p}, {"params": [torch.nn.Parameter(torch.zeros(1))],
                                    "betas": (0.8, 0.99)}])
    opt = OneBitAdam(p, freeze_step=10)
    with pytest.raises(ValueError, match="'onebit'"):
        gt.hook("topk", adam=opt)
    with pytest.raises(ValueError, match="beta1"):
        gt.hook("onebit", adam=opt, momentum=0.5)
    with pytest.raises(ValueError, match="freeze_step"):
        gt.hook("onebit", adam=opt, start_iter=3)
    with pytest.raises(ValueError, match="OneBitAdam"):
        gt.hook("onebit", adam=torch.optim.AdamW(p))
    state, _ = gt.hook("onebit", adam=opt)
    assert state.start_iter == 10 and state.options["momentum"] == 0.9


FREEZE = 5


def _pair(world, lr=1e-2):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    opt = OneBitAdam(model.parameters(), lr=lr, weight_decay=0.01, freeze_step=FREEZE)
    state, h = gt.hook("onebit", adam=opt)
    model.register_comm_hook(state, h)
    return model, opt, state


def _train(rank, world, out, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, opt, state = _pair(world)
    # the warm-up against plain DDP with torch's AdamW on the same data
    torch.manual_seed(0)
    ref = DDP(Net())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    data = make_data(rank, steps, seed=3)
    losses, wire = [], []
    for t, (x, y) in enumerate(data, start=1):
        pairs = ((model, opt), (ref, ropt)) if t <= FREEZE else ((model, opt),)
        for i, (m, o) in enumerate(pairs):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            if i == 0:
                losses.append(float(loss))
        wire.append(state.totals["wire_bytes"] - sum(wire))
        if t == FREEZE:
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            v_at_freeze = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        assert params_equal_across_ranks(model), f"ranks differ after step {t}"
    for p, v in zip(model.parameters(), v_at_freeze):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v), "the variance moved after the freeze"
    warm, comp = np.mean(wire[1:FREEZE]), np.mean(wire[FREEZE:])
    if world > 1:  # the 1-bit steps move >= 20x fewer bytes than the full-precision ones
        assert warm / comp >= 20, (warm, comp)
    # it trains on after the freeze (AdamW itself reaches about half of 1-bit Adam's final
    # loss on this task in 32 steps)
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
    mark_ok(out, rank)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pair_trains_ranks_agree_variance_frozen_bytes_drop(world):
    run_ok(_train, world, 32)


def _resume(rank, world, out):
    data = make_data(rank, 14, seed=5)
    path = os.path.join(out, "ck.pt")
    # straight: 14 steps; resumed: 9 steps, checkpoint, fresh objects, 5 more
    model, opt, state = _pair(world)
    train(model, opt, data)
    torch.save(model.module.state_dict(), os.path.join(out, f"final_straight_{rank}.pt"))
    model, opt, state = _pair(world)
    train(model, opt, data[:9])
    save_checkpoint(path + f".{rank}", model, opt, state)
    model, opt, state = _pair(world)
    load_checkpoint(path + f".{rank}", model, opt, state)
    train(model, opt, data[9:])
    torch.save(model.module.state_dict(), os.path.join(out, f"final_resume_{rank}.pt"))
    mark_ok(out, rank)


def _mismatched(rank, world, out):
    data = make_data(rank, 9, seed=5)
    model, opt, state = _pair(world)
    for t, (x, y) in enumerate(data, start=1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if t == FREEZE - 2:
            opt_before = copy.deepcopy(opt.state_dict())  # the optimizer in its warm-up
    after = (copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict()),
             state.state_dict())
    # the model and the hook from after the freeze, the optimizer from before it: refused at the
    # next backward on every rank, nothing moves; the matching pair then trains on
    model, opt, state = _pair(world)
    model.module.load_state_dict(after[0])
    opt.load_state_dict(opt_before)
    state.load_state_dict(after[2])
    x, y = data[-1]
    opt.zero_grad()
    with pytest.raises(ValueError, match="different points of training"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert state.iter == 9
    opt.load_state_dict(after[1])
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    assert state.iter == 12 and math.isfinite(float(loss))
    assert params_equal_across_ranks(model)
    mark_ok(out, rank)


def test_optimizer_and_hook_from_different_checkpoints_are_refused():
    run_ok(_mismatched, 2)


def test_checkpoint_round_trip_in_the_compressed_phase():
    """Nine steps (four compressed), a checkpoint of the module, the optimizer and the hook,
    fresh objects restored from it, five more steps: bitwise the parameters of 14 straight
    steps."""
    from ddp_util import run, tmpdir

    out = tmpdir()
    run(_resume, 2, out)
    assert_resumed_equals_straight(out, 2, "1-bit Adam")


def _overflow(rank, world, out):
    """After the freeze, rank 1's loss is Inf for one step (an fp16 overflow): every rank's
    backward returns, the step is skipped on every rank (as GradScaler would: the optimizer does
    not run when a gradient is not finite), the variance, momentum and errors stay, and the ranks
    go on training in agreement."""
    model, opt, state = _pair(world)
    data = make_data(rank, 14, seed=7)
    for t, (x, y) in enumerate(data, start=1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if t == 9 and rank == 1:
            loss = loss * float("inf")
        before = state.state_dict() if t == 9 else None
        loss.backward()
        finite = torch.tensor([float(all(torch.isfinite(p.grad).all() for p in model.parameters()))])
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if t == 9:
            assert finite.item() == 0.0, "the overflow step was not marked on every rank"
            assert state.skipped_steps == 1 and state.iter == 8
            after = state.state_dict()
            assert after["iter"] == before["iter"]
            assert after["buckets"] == before["buckets"]  # momentum and errors unchanged
            continue  # GradScaler skips optimizer.step()
        assert finite.item() == 1.0
        opt.step()
    assert state.iter == 13 and params_equal_across_ranks(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    mark_ok(out, rank)


def test_an_overflow_on_one_rank_after_the_freeze_is_skipped_on_every_rank():
    run_ok(_overflow, 2)


def _grad_scaler(rank, world, out):
    """1-bit Adam under fp16 autocast with torch.amp.GradScaler: after the freeze the scale is
    set so high that the gradients overflow. The hook skips the step on every rank (it does not
    count it), GradScaler skips optimizer.step(): the frozen variance, Adam's step count and
    moments, the hook's momentum and errors and the parameters are bitwise as before; with the
    scale lowered again the ranks train on in agreement."""
    model, opt, state = _pair(world, lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    data = make_data(rank, 14, seed=9)
    for t, (x, y) in enumerate(data, start=1):
        if t == 9:
            scaler.update(2.0 ** 100)  # the fp16 activation gradients overflow at this scale
            before = {"hook": state.state_dict(), "skipped": state.skipped_steps,
                      "opt": {i: {k: (v.clone() if torch.is_tensor(v) else v)
                                  for k, v in opt.state[p].items()}
                              for i, p in enumerate(model.parameters())},
                      "params": [p.detach().clone() for p in model.parameters()]}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if t == 9:
            assert state.skipped_steps == before["skipped"] + 1
            after = state.state_dict()
            assert after["iter"] == before["hook"]["iter"]
            assert after["buckets"] == before["hook"]["buckets"]  # momentum and errors
            for i, p in enumerate(model.parameters()):
                assert torch.equal(p, before["params"][i])
                for k, v in opt.state[p].items():
                    w = before["opt"][i][k]
                    assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), k
            scaler.update(2.0 ** 8)
    assert state.skipped_steps == 1 and state.iter == 13
    assert params_equal_across_ranks(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    mark_ok(out, rank)


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler on the CPU needs torch 2.x")
def test_grad_scaler_overflow_after_the_freeze_leaves_every_state_as_it_was():
    run_ok(_grad_scaler, 2)
