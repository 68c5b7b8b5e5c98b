# SPDX-License-Identifier: Apache-2.0
"""compress_fsdp used as a careless or hostile user would, on 2 gloo ranks: a second call on the
same model, frozen parameters, a one-element parameter, bf16 and fp32 modules in one model,
reshard_after_forward=False, gradient accumulation with and without
set_requires_gradient_sync(False), an Inf on one rank under torch.amp.GradScaler, a checkpoint
resumed in new processes, and damaged checkpoints. Each is compared with what FSDP2's own
collectives do (bitwise for the lossless "allreduce" plans, within the codec's rounding for
4-bit) or with a run that never had the disturbance. The scenarios share one spawn of ranks
(a spawn costs seconds); only the checkpoint's resumed run needs a second (new processes)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import gradcomp.torch as gt
from ddp_util import Net, make_data, run, tmpdir
from fsdp_util import local_grads, local_params, needs_fsdp2, shard, sharded_net

pytestmark = needs_fsdp2


def _mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


class _Gained(torch.nn.Module):
    """Net's layers and a one-element gain owned by the root FSDP module (its padded shard is
    empty on rank 1)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 37)
        self.fc2 = torch.nn.Linear(37, 37)
        self.fc3 = torch.nn.Linear(37, 8)
        self.gain = torch.nn.Parameter(torch.full((1,), 1.25))

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc3(h) * self.gain


def _frozen(seed=0, bias_frozen=True):
    """_Gained with fc1 frozen whole and fc2's bias frozen (fine-tuning), sharded."""
    torch.manual_seed(seed)
    m = _Gained()
    m.fc1.requires_grad_(False)
    m.fc2.bias.requires_grad_(not bias_frozen)
    return shard(m, (m.fc1, m.fc2, m.fc3))


def _states(sd):
    """A compress_fsdp state_dict's states, comparable with ==."""
    return {k: [(e["numel"], e["dtype"], e["state"]) for e in v] for k, v in sd["modules"].items()}


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def _quant_after_one_step(rank):
    """A sharded model compressed with 4-bit gradients after one backward (a state to look at),
    with its batch."""
    x, y = make_data(rank, 1)[0]
    m = sharded_net()
    comp = gt.compress_fsdp(m, grads="quant", bits=4)
    _mse(m, x, y).backward()
    return m, comp, x, y


# ---- 1. a second compress_fsdp on the same model
def _twice(rank, world):
    m, comp, x, y = _quant_after_one_step(rank)
    before = comp.state_dict()
    for kw in [dict(grads="quant", bits=4),          # the same again
               dict(grads=None, params="int8"),      # only what the first left alone
               dict(grads="bf16", modules=["fc1"])]:  # a part of the modules
        with pytest.raises(ValueError, match=r"\['<root>', 'fc1', 'fc2', 'fc3'\] of this model "
                                             "already run the collectives of an earlier"):
            gt.compress_fsdp(m, **kw)
    with pytest.raises(ValueError, match="earlier compress_fsdp"):  # a part of the model
        gt.compress_fsdp(m.fc2, grads="bf16")
    # modules FSDP was left to by modules= count too: they share the first call's backward
    part = sharded_net()
    gt.compress_fsdp(part, grads="quant", modules=["fc1"])
    with pytest.raises(ValueError, match="earlier compress_fsdp"):
        gt.compress_fsdp(part, grads="quant", modules=["fc2", "fc3"])
    # nothing of the refused calls is left: the first one's collectives still run, alone
    m.zero_grad()
    _mse(m, x, y).backward()
    assert comp.totals()["reduce_scatter"]["calls"] == 6
    assert comp.totals()["allgather"]["calls"] == 0  # params= of a refused call never ran
    assert _states(comp.state_dict()) != _states(before)  # its error feedback moved on
    # another model is not refused
    gt.compress_fsdp(sharded_net(), grads="quant", bits=4)

    # a module that refuses a custom collective (FSDP does with several parameter groups) after
    # others took theirs: the call fails, and the model trains with FSDP's own collectives,
    # bitwise, until a later call compresses it
    def refuse(comm):
        raise ValueError("not with several parameter groups")

    failed, ref = sharded_net(), sharded_net()
    failed.fc3.set_custom_all_gather = refuse
    with pytest.raises(ValueError, match="module 'fc3' refused a custom collective"):
        gt.compress_fsdp(failed, grads="quant", bits=4, params="int8")
    for mod in (failed, ref):
        _mse(mod, x, y).backward()
    assert all(torch.equal(a, b) for a, b in zip(local_grads(ref), local_grads(failed)))
    del failed.fc3.set_custom_all_gather
    again = gt.compress_fsdp(failed, grads="quant", bits=4, params="int8")
    _mse(failed, x, y).backward()
    assert again.totals()["reduce_scatter"]["calls"] == 3


# ---- 2. frozen parameters (a whole FSDP module, one parameter of another); 3. one element
def _frozen_params(rank, world):
    data = make_data(rank, 3)
    ref, ours = _frozen(), _frozen()
    gt.compress_fsdp(ours, grads="allreduce", params="allreduce")
    o_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    o_ours = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.05)
    start = local_params(ours)
    for x, y in data:
        for m, o in ((ref, o_ref), (ours, o_ours)):
            o.zero_grad()
            _mse(m, x, y).backward()
            o.step()
        for a, b in zip(local_grads(ref), local_grads(ours)):
            assert (a is None and b is None) or torch.equal(a, b)
    for (n, p), a, b, s in zip(ours.named_parameters(), local_params(ref), local_params(ours),
                               start):
        assert torch.equal(a, b), n
        if b.numel():  # (rank 1's shard of the gain is empty)
            assert torch.equal(b, s) != p.requires_grad, n  # only the trainable ones moved
    gain = ours.gain.grad.full_tensor()  # the one-element parameter: FSDP's value, bitwise
    assert gain.shape == (1,) and torch.equal(gain, ref.gain.grad.full_tensor())

    # 4-bit: fc1 never reduce-scatters, fc2's buffer holds its weight alone, the root's the
    # gain (1 element, padded to 2)
    x, y = data[0]
    ref, ours = _frozen(), _frozen()
    comp = gt.compress_fsdp(ours, grads="quant", bits=4, params="int8")
    for m in (ref, ours):
        _mse(m, x, y).backward()
    assert comp.totals()["reduce_scatter"]["calls"] == 3
    for (n, p), a, b in zip(ours.named_parameters(), local_grads(ref), local_grads(ours)):
        if p.requires_grad and a.numel():
            assert _rel(a, b) < 0.4, n
    rel_gain = _rel(ref.gain.grad.full_tensor(), ours.gain.grad.full_tensor())
    assert rel_gain < 0.05, rel_gain  # one value in a block of its own: only int8 weights
    sd = comp.state_dict()
    assert sd["modules"]["fc1"] == []  # listed, with nothing to restore
    assert [e["numel"] for e in sd["modules"]["fc2"]] == [38 * 37]  # no bias
    assert [e["numel"] for e in sd["modules"]["<root>"]] == [2]  # the gain, padded to 2 ranks
    # the checkpoint restores into a model frozen alike, and continues bitwise
    twin = _frozen()  # (the same parameters: ours took no optimizer step)
    comp2 = gt.compress_fsdp(twin, grads="quant", bits=4, params="int8")
    comp2.load_state_dict(copy.deepcopy(sd))
    x2, y2 = data[1]
    for m in (ours, twin):
        m.zero_grad()
        _mse(m, x2, y2).backward()
    for n, a, b in zip([n for n, _ in ours.named_parameters()], local_grads(ours),
                       local_grads(twin)):
        assert (a is None and b is None) or torch.equal(a, b), n
    # ... and into one frozen otherwise it is refused, nothing changed
    other = _frozen(bias_frozen=False)
    comp3 = gt.compress_fsdp(other, grads="quant", bits=4, params="int8")
    with pytest.raises(ValueError, match=r"'fc2'.*frozen"):
        comp3.load_state_dict(copy.deepcopy(sd))
    assert all(v == [] for v in comp3.state_dict()["modules"].values())
    # a checkpoint that omits the frozen module (as gradcomp wrote them before) loads too
    comp2.load_state_dict({**sd, "modules": {k: v for k, v in sd["modules"].items()
                                             if k != "fc1"}})


# ---- 4. bf16 and fp32 modules in one model
class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 37).to(torch.bfloat16)
        self.b = torch.nn.Linear(37, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.to(torch.bfloat16))).float())


def _mixed_net():
    torch.manual_seed(0)
    m = _Mixed()
    return shard(m, (m.a, m.b))


def _mixed(rank, world):
    x, y = make_data(rank, 1, batch=64)[0]
    ref = _mixed_net()
    _mse(ref, x, y).backward()
    want = local_grads(ref)
    for grads, params in [("allreduce", "allreduce"), ("quant", None), ("quant", "int8"),
                          (None, "int8"), ("bf16", "bf16")]:
        ours = _mixed_net()
        comp = gt.compress_fsdp(ours, grads=grads, params=params,
                                **({"bits": 4} if grads == "quant" else {}))
        _mse(ours, x, y).backward()
        got = local_grads(ours)
        assert [g.dtype for g in got] == [torch.bfloat16] * 2 + [torch.float32] * 2
        for a, b in zip(want, got):
            if (grads, params) == ("allreduce", "allreduce"):
                assert torch.equal(a, b)
            else:
                assert _rel(a.float(), b.float()) < 0.4, (grads, params)
        if grads == "quant":
            sd = comp.state_dict()
            assert [(e["dtype"], e["numel"]) for e in sd["modules"]["a"]] == \
                [("bfloat16", 38 * 32 + 38)]
            assert [(e["dtype"], e["numel"]) for e in sd["modules"]["b"]] == \
                [("float32", 8 * 37 + 8)]
        if params is not None:
            assert comp.totals()["allgather"]["calls"] >= 2


# ---- 5. reshard_after_forward=False
def _no_reshard(rank, world):
    data = make_data(rank, 3)
    ref, ours = sharded_net(reshard_after_forward=False), sharded_net(reshard_after_forward=False)
    comp = gt.compress_fsdp(ours, grads="allreduce", params="allreduce")
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    for x, y in data:
        for m, o in ((ref, o_ref), (ours, o_ours)):
            o.zero_grad()
            _mse(m, x, y).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(local_params(ref), local_params(ours)))
    t = comp.totals()
    assert t["reduce_scatter"]["calls"] == 9
    assert t["allgather"]["calls"] == 9  # kept from forward to backward: one per module a step
    q = sharded_net(reshard_after_forward=False)
    gt.compress_fsdp(q, grads="quant", bits=4, params="int8")
    _mse(q, *data[0]).backward()
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in q.parameters()])
    assert torch.isfinite(full).all()
    every = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(every, full)
    assert all(torch.equal(every[0], g) for g in every)


# ---- 6. gradient accumulation
def _accumulate(rank, world):
    data = make_data(rank, 3, batch=64)

    def accumulate(model, batches, no_sync):
        for i, (x, y) in enumerate(batches):
            if no_sync:  # only the last micro-batch reduce-scatters
                model.set_requires_gradient_sync(i == len(batches) - 1)
            _mse(model, x, y).backward()
        return local_grads(model)

    for no_sync in (False, True):
        want = accumulate(sharded_net(), data, no_sync)
        lossless = sharded_net()
        comp = gt.compress_fsdp(lossless, grads="allreduce")
        assert all(torch.equal(a, b) for a, b in
                   zip(want, accumulate(lossless, data, no_sync)))
        assert comp.totals()["reduce_scatter"]["calls"] == (3 if no_sync else 9)
        q = sharded_net()
        gt.compress_fsdp(q, grads="quant", bits=4)
        for a, b in zip(want, accumulate(q, data, no_sync)):
            assert _rel(a, b) < 0.3, no_sync

    # error feedback across micro-batches: the same batch 8 times, each reduce-scattered, sums
    # to 8 x FSDP's gradient with the rounding of about one step (each step's error is carried
    # into the next, neither dropped nor counted twice); the first step alone rounds as much
    one = {}
    for n in (1, 8):
        ref, q = sharded_net(), sharded_net()
        gt.compress_fsdp(q, grads="quant", bits=4)
        for m in (ref, q):
            for _ in range(n):
                _mse(m, *data[0]).backward()
        one[n] = max(_rel(a, b) for a, b in zip(local_grads(ref), local_grads(q)))
    assert one[8] < 0.3 * one[1], one


# ---- 7. an Inf on one rank under torch.amp.GradScaler
class _Poison(torch.autograd.Function):
    """Identity forward; in backward, Inf times the gradient on rank 1 when armed: only the layers
    before it get non-finite gradients (as an fp16 overflow deep in a network does), so the later
    modules' reduce-scatters take error-feedback steps that must be taken back."""
    armed = False

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf") if _Poison.armed and dist.get_rank() == 1 else g


class _PoisonNet(Net):
    def forward(self, x):
        h = _Poison.apply(torch.relu(self.fc1(x)))
        return self.fc3(torch.relu(self.fc2(h)))


def _scaled(rank, world):
    # torch.amp.GradScaler("cpu") came with torch 2.3, before FSDP2's custom collectives: every
    # torch this file runs on has it
    data = make_data(rank, 5, batch=32)
    BAD = 2

    def train(mode):
        torch.manual_seed(0)
        m = _PoisonNet(d_hidden=37)
        shard(m, (m.fc1, m.fc2, m.fc3))
        comp = gt.compress_fsdp(m, grads="quant", bits=4, params="int8")
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i, (x, y) in enumerate(data):
            if i == BAD and mode == "without":  # the step never happened, the scale halved
                scaler.update(new_scale=scaler.get_scale() / 2)
                continue
            _Poison.armed = i == BAD and mode != "without"
            before = comp.state_dict() if mode == "inspect" else None
            opt.zero_grad()
            scaler.scale(_mse(m, x, y)).backward()
            _Poison.armed = False
            scaler.step(opt)
            scaler.update()
            if i == BAD:
                # fc1's shard is NaN on every rank: each rank's scaler skips the step
                assert not torch.isfinite(m.fc1.weight.grad.to_local()).all()
                assert torch.isfinite(m.fc3.weight.grad.to_local()).all()
                assert scaler.get_scale() == 512.0
            if before is not None:  # state_dict() settles at once: the skipped step left nothing
                assert (_states(comp.state_dict()) == _states(before)) == (i == BAD), i
        return local_params(m), _states(comp.state_dict())

    # "inf" settles the skipped step where a training loop does (the next backward)
    p_without, s_without = train("without")
    for mode in ("inf", "inspect"):
        p, st = train(mode)
        assert all(torch.equal(a, b) for a, b in zip(p, p_without)), mode
        assert st == s_without, mode


# ---- 9. damaged checkpoints
def _damaged(rank, world):
    m, comp, x, y = _quant_after_one_step(rank)
    sd = comp.state_dict()
    e0 = sd["modules"]["fc1"][0]

    def top(**kw):
        return {**copy.deepcopy(sd), **kw}

    def without(key):
        return {k: v for k, v in copy.deepcopy(sd).items() if k != key}

    def entry(**kw):
        d = copy.deepcopy(sd)
        d["modules"]["fc1"][0].update(kw)
        return d

    def mods(**kw):
        return top(modules={**copy.deepcopy(sd["modules"]), **kw})

    cases = [
        (None, "not a compress_fsdp state_dict"),
        ([sd], "not a compress_fsdp state_dict"),
        (b"gradcomp-fsdp", "not a compress_fsdp state_dict"),
        ({}, "not a compress_fsdp state_dict"),
        (without("format"), "not a compress_fsdp state_dict"),
        (without("version"), "version"),
        (without("world"), "saved by None ranks"),
        (without("rank"), "rank None"),
        (without("grads"), "grads=None"),
        (without("grad_options"), "made with"),
        (without("modules"), "must be a dict"),
        (top(world=world + 1), "cannot be resharded"),
        (top(world=str(world)), "saved by 2 ranks"),
        (top(rank=1 - rank), "load each rank's own"),
        (top(modules=[]), "must be a dict"),
        (top(modules={}), r"no state for modules \['fc1', 'fc2', 'fc3'\]"),
        (top(modules={1: [], None: []}), "keyed by module names"),
        (top(modules={"fc9": []}), "fc9"),
        (mods(fc1=None), "a list of states"),
        (mods(fc1=[None]), "an entry must be a dict"),
        (mods(fc1=[e0, e0]), "two states for the same reduce-scatter"),
        (mods(fc1=[{k: v for k, v in e0.items() if k != "state"}]), "'state' is NoneType"),
        (entry(state=e0["state"][:-1]), "truncated"),
        (entry(state=e0["state"][:len(e0["state"]) // 2]), "cannot hold"),
        (entry(state=e0["state"] + b"\0"), "corrupt"),
        (entry(state=memoryview(e0["state"])), "'state' is memoryview"),
        (entry(numel=float(e0["numel"])), "'numel' is float"),
        (entry(numel=-world), "entry of"),
        (entry(world=0), r"as rank \d of 0"),
        (entry(dtype="float64"), "dtype"),
        (entry(rank=1 - rank), "rank"),
    ]
    before = comp.state_dict()
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            comp.load_state_dict(bad)
        assert _states(comp.state_dict()) == _states(before), match
    comp.load_state_dict(copy.deepcopy(sd))  # the intact one still loads


# ---- 8. a checkpoint resumed in new processes
STEPS, SAVE = 4, 2


def _train_span(rank, out, resume):
    """Trains steps SAVE.. from the checkpoint (resume) or 0.. with a checkpoint at SAVE, and
    writes the final shards and compressor state. The model and optimizer are saved as each
    rank's local shards (what a sharded checkpoint holds); the compressor's state as
    comp.state_dict()."""
    from torch.distributed.tensor import DTensor
    data = make_data(rank, STEPS, seed=3)
    m = _frozen()  # frozen parameters and the one-element gain: the hardest layout
    comp = gt.compress_fsdp(m, grads="quant", bits=4, params="int8")
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    path = os.path.join(out, f"ckpt_{rank}.pt")
    start = 0
    if resume:
        ck = torch.load(path)
        with torch.no_grad():
            for p, t in zip(m.parameters(), ck["model"]):
                p.to_local().copy_(t)
        opt.load_state_dict(ck["opt"])
        for p in params:  # the momenta were saved as local shards: sharded like the parameters
            st = opt.state[p]
            st["momentum_buffer"] = DTensor.from_local(
                st["momentum_buffer"], p.device_mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride())
        comp.load_state_dict(ck["comp"])
        start = SAVE
    for i in range(start, STEPS):
        if i == SAVE and not resume:
            osd = opt.state_dict()  # (its per-parameter dicts are the optimizer's own)
            osd["state"] = {k: {**st, "momentum_buffer": st["momentum_buffer"].to_local()}
                            for k, st in osd["state"].items()}
            torch.save({"model": local_params(m), "opt": osd, "comp": comp.state_dict()}, path)
        opt.zero_grad()
        _mse(m, *data[i]).backward()
        opt.step()
    final = {"params": local_params(m), "comp": _states(comp.state_dict())}
    torch.save(final, os.path.join(out, f"final_{'resume' if resume else 'straight'}_{rank}.pt"))


def _scenarios(rank, world, out):
    for scenario in (_twice, _frozen_params, _mixed, _no_reshard, _accumulate, _scaled,
                     _damaged):
        scenario(rank, world)
        dist.barrier()  # a rank that failed has raised; the other stops here, not in a collective
    _train_span(rank, out, resume=False)  # 8.'s uninterrupted run, and its checkpoint


def _resume(rank, world, out):
    _train_span(rank, out, resume=True)


def test_hostile_scenarios():
    """Scenarios 1-7 and 9 and the uninterrupted run of 8 in one spawn of ranks; 8.'s resumed run
    in a second (new processes, a new process group, a fresh model, optimizer and
    compress_fsdp), which must end bitwise where the uninterrupted one did."""
    out = tmpdir()
    run(_scenarios, 2, out)
    run(_resume, 2, out)
    for rank in range(2):
        a = torch.load(os.path.join(out, f"final_straight_{rank}.pt"))
        b = torch.load(os.path.join(out, f"final_resume_{rank}.pt"))
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), rank
        assert a["comp"] == b["comp"] and a["comp"]["fc2"], rank
