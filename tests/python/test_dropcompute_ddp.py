# SPDX-License-Identifier: Apache-2.0
"""DropCompute with DDP: 4 gloo ranks on loopback (forked from the fork server,
ddp_util.start_ranks).

- normalisation (b) gives exactly the mean of the computed micro-batch gradients, with drops,
  at each drop point; (a) the sum over N*M; exactly one allreduce (one comm-hook call) per step;
- an injected slow rank: the step time falls with DropCompute, every rank gets the same tau
  bitwise and the parameters stay bitwise identical; the same stacked with the top-k hook.
"""
import os
import struct
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.torch.dropcompute import DropCompute  # noqa: E402

from ddp_util import finish, free_port, start_ranks  # noqa: E402

WORLD = 4


def init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)




def spawn(fn, tmp_path, *args):
    start_ranks(fn, (WORLD, free_port(), str(tmp_path)) + args, WORLD)
    return [torch.load(os.path.join(tmp_path, f"r{r}.pt")) for r in range(WORLD)]


def gather_flat(t):
    outs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, t)
    return outs


def counting_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state["calls"] += 1
    return allreduce_hook(None, bucket)


class ManualClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# -- normalisation ---------------------------------------------------------------------------------
M_NORM, TAU_NORM, DIM = 8, 5.0, 5
EXPECTED_COUNTS = {"before_forward": [6, 3, 2, 2], "after_backward": [6, 3, 2, 2],
                   "between_forward_backward": [5, 2, 1, 1]}


def mb_data(rank, m):
    g = torch.Generator().manual_seed(1000 * rank + m)
    return torch.randn(3, DIM, generator=g, dtype=torch.float64).float()


def _normalization_worker(rank, world, port, out):
    init(rank, world, port)
    res = {}
    runs = [(p, n, False) for p in EXPECTED_COUNTS for n in ("actual", "nominal")]
    runs.append(("before_forward", "actual", True))  # the sync pass with find_unused_parameters
    for point, norm, unused in runs:
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Linear(DIM, 1, bias=False), find_unused_parameters=unused)
        hs = {"calls": 0}
        ddp.register_comm_hook(hs, counting_hook)
        clk = ManualClock()
        dc = DropCompute(ddp, M_NORM, tau=TAU_NORM, drop_point=point, normalization=norm,
                         timer=clk)
        grads = []
        for step in range(2):
            ddp.zero_grad(set_to_none=True)
            data = (mb_data(rank, m) for m in range(M_NORM))
            for x in dc.microbatches(data):
                if point == "between_forward_backward":
                    loss = ddp(x).mean()
                    clk.t += rank + 1  # the forward takes rank + 1 time units
                    dc.backward(loss)
                else:
                    ddp(x).mean().backward()
                    clk.t += rank + 1
            grads.append(ddp.module.weight.grad.detach().clone().double())
        key = (point, norm) + (("unused",) if unused else ())
        res[key] = {"grads": grads, "completed": dc.last["completed"],
                    "total": dc.last["total_completed"], "calls": hs["calls"],
                    "sync_pass": dc.last["sync_pass"]}
    torch.save(res, os.path.join(out, f"r{rank}.pt"))
    finish()


def test_normalization_is_the_mean_of_computed_microbatch_gradients(tmp_path):
    res = spawn(_normalization_worker, tmp_path)
    for point, counts in EXPECTED_COUNTS.items():
        # per-sample gradient of mean_i(w . x_i) is x_i: a micro-batch's gradient is mean_i x_i
        mb_grads = [[mb_data(r, m).double().mean(0) for m in range(counts[r])]
                    for r in range(WORLD)]
        total = sum(counts)
        summed = sum(g for per in mb_grads for g in per)
        keys = [(point, "actual"), (point, "nominal")]
        if point == "before_forward":
            keys.append((point, "actual", "unused"))
        for key in keys:
            norm = key[1]
            expected = summed / (total if norm == "actual" else WORLD * M_NORM)
            for r in range(WORLD):
                got = res[r][key]
                assert got["completed"] == counts[r], (point, r)
                assert got["calls"] == 2, "exactly one allreduce (one hook call) per step"
                assert got["sync_pass"] == (counts[r] < M_NORM or
                                            point == "between_forward_backward")
                if norm == "actual":
                    assert got["total"] == total
                for g in got["grads"]:
                    torch.testing.assert_close(g.reshape(-1), expected, rtol=2e-6, atol=1e-7)
                assert torch.equal(got["grads"][0], res[0][key]["grads"][0])


# -- slow rank ------------------------------------------------------------------------------------
M_SLOW, SLOW_S, FAST_S = 6, 0.04, 0.003


def make_model():
    torch.manual_seed(0)
    # BatchNorm: DDP broadcasts buffers in the first forward of each step, which must stay
    # matched across ranks that compute different numbers of micro-batches
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def batches(rank):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def work(rank, model, x, y):
    time.sleep(SLOW_S if rank == WORLD - 1 else FAST_S)  # the injected slow rank
    return torch.nn.functional.mse_loss(model(x), y)


def _ddp_and_opt(hook):
    """A fresh DDP model (with the gradcomp hook `hook`, if any) and its optimizer."""
    ddp = DDP(make_model())
    if hook:
        ddp.register_comm_hook(*gradcomp.torch.hook(hook, ratio=0.01))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def _timed_steps(steps, opt, backward):
    """The wall time of each of `steps` optimizer steps whose gradients backward() computes; the
    ranks start each step together (a barrier), so that a step's time is the slow rank's."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _slow_rank_worker(rank, world, port, out, hook):
    init(rank, world, port)
    res = {}
    # baseline: the usual accumulation loop (no_sync for all but the last micro-batch)
    ddp, opt = _ddp_and_opt(hook)
    it = batches(rank)

    def accumulate():
        for m in range(M_SLOW):
            x, y = next(it)
            if m < M_SLOW - 1:
                with ddp.no_sync():
                    (work(rank, ddp, x, y) / M_SLOW).backward()
            else:
                (work(rank, ddp, x, y) / M_SLOW).backward()

    times = _timed_steps(5, opt, accumulate)
    res["base_time"] = sorted(times[1:])[len(times[1:]) // 2]

    # DropCompute, automatic tau after 2 measured steps
    ddp, opt = _ddp_and_opt(hook)
    dc = DropCompute(ddp, M_SLOW, tau=None, warmup_steps=2, normalization="actual")
    it = batches(rank)

    def drop_compute():
        for x, y in dc.microbatches(it):
            work(rank, ddp, x, y).backward()

    times = _timed_steps(7, opt, drop_compute)
    res["dc_time"] = sorted(times[3:])[len(times[3:]) // 2]
    res["tau"] = dc.tau
    res["estimates"] = len(dc.estimates)
    res["drop_rate"] = dc.drop_rate
    taus = gather_flat(torch.tensor([dc.tau], dtype=torch.float64))
    res["taus_bitwise_equal"] = all(struct.pack("<d", float(t)) == struct.pack("<d", dc.tau)
                                    for t in taus)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    res["params_equal"] = all(torch.equal(flat, o) for o in gather_flat(flat))
    res["finite"] = bool(torch.isfinite(flat).all())
    torch.save(res, os.path.join(out, f"r{rank}.pt"))
    finish()


def check_slow_rank(res):
    base, fast = res[0]["base_time"], res[0]["dc_time"]
    print(f"step time: baseline {base:.3f} s, DropCompute {fast:.3f} s, tau {res[0]['tau']:.4f} s")
    assert base > M_SLOW * SLOW_S * 0.9
    assert fast < 0.6 * base, f"DropCompute step {fast:.3f} s vs baseline {base:.3f} s"
    for r in range(WORLD):
        assert res[r]["estimates"] == 1
        assert res[r]["taus_bitwise_equal"], "every rank must compute the same tau"
        assert res[r]["params_equal"] and res[r]["finite"]
        assert struct.pack("<d", res[r]["tau"]) == struct.pack("<d", res[0]["tau"])
    assert res[WORLD - 1]["drop_rate"] > 0.3  # the slow rank drops
    # the fast ranks finish (nearly) all their micro-batches: tau* sits at an observed cumulative
    # time of theirs, so timing jitter can cost one of their micro-batches now and then. With 4
    # ranks and the hook's worker threads on 2 shared cores one fast rank can be starved for a
    # whole run (2 of 3 fresh-clone CI runs on 2026-11-25: one fast rank dropped as much as the
    # slow one, 0.476, with tau 42 ms; quiet local runs: 0.0), so the median fast rank is checked
    rates = [res[r]["drop_rate"] for r in range(WORLD)]
    print("drop rates per rank:", [round(x, 3) for x in rates])
    assert sorted(rates[:-1])[(WORLD - 1) // 2] < rates[-1] / 2


def test_slow_rank_step_time_falls_and_ranks_stay_identical(tmp_path):
    check_slow_rank(spawn(_slow_rank_worker, tmp_path, None))


def test_slow_rank_stacked_with_topk_hook(tmp_path):
    check_slow_rank(spawn(_slow_rank_worker, tmp_path, "topk"))


# -- single process -------------------------------------------------------------------------------
def test_single_process_plain_module_nominal_scale():
    model = torch.nn.Linear(DIM, 1, bias=False)
    clk = ManualClock()
    dc = DropCompute(model, 4, tau=2.5, timer=clk)
    model.zero_grad()
    for m, x in enumerate(dc.microbatches(mb_data(0, m) for m in range(4))):
        model(x).mean().backward()
        clk.t += 1.0
    assert dc.last["completed"] == 3  # starts at 0, 1, 2; at 3 > 2.5 it stops
    expected = sum(mb_data(0, m).double().mean(0) for m in range(3)) / 4
    torch.testing.assert_close(model.weight.grad.double().reshape(-1), expected, rtol=2e-6,
                               atol=1e-7)
    assert dc.drop_rate == pytest.approx(0.25)


def test_dropcompute_bad_input():
    model = torch.nn.Linear(2, 1)
    for kw, match in [(dict(micro_batches=0), "micro_batches"),
                      (dict(micro_batches=2.5), "micro_batches"),
                      (dict(micro_batches=4, tau=0.0), "tau"),
                      (dict(micro_batches=4, tau=-1.0), "tau"),
                      (dict(micro_batches=4, tau=float("nan")), "tau"),
                      (dict(micro_batches=4, drop_point="sometimes"), "drop_point"),
                      (dict(micro_batches=4, normalization="mean"), "normalization"),
                      (dict(micro_batches=4, warmup_steps=0), "warmup_steps"),
                      (dict(micro_batches=4, serial_time=float("nan")), "serial_time"),
                      (dict(micro_batches=4, serial_time=-1.0), "serial_time"),
                      (dict(micro_batches=4, timer="sundial"), "timer")]:
        with pytest.raises(ValueError, match=match):
            DropCompute(model, **kw)


def test_between_mode_requires_dc_backward():
    model = torch.nn.Linear(DIM, 1, bias=False)
    dc = DropCompute(model, 2, tau=1.0, drop_point="between_forward_backward")
    with pytest.raises(RuntimeError, match="dc.backward"):
        for x in dc.microbatches(mb_data(0, m) for m in range(2)):
            model(x).mean().backward()
    # the helper recovered: a later step works
    for x in dc.microbatches(mb_data(0, m) for m in range(2)):
        dc.backward(model(x).mean())
    assert dc.last["completed"] >= 1


def test_overflow_step_leaves_no_latency_sample():
    """A measured step whose gradients are not finite (a loss-scaler overflow, skipped by the
    optimizer) is not kept: the automatic tau equals that of a run without the step, even though
    that step's micro-batches were far slower."""
    def run(bad_step):
        torch.manual_seed(0)
        model = torch.nn.Linear(DIM, 1, bias=False)
        clk = ManualClock()
        dc = DropCompute(model, 3, tau=None, warmup_steps=2, serial_time=0.5, timer=clk)
        for s in range(4):
            model.zero_grad()
            for m, x in enumerate(dc.microbatches(mb_data(s, m) for m in range(3))):
                loss = model(x).mean()
                if s == bad_step:
                    loss = loss * float("inf")
                loss.backward()
                clk.t += 9.0 if s == bad_step else 1.0 + 0.5 * m
        return dc

    bad, never = run(bad_step=1), run(bad_step=None)
    assert bad.skipped_measurements == 1 and never.skipped_measurements == 0
    # each estimated once, from 2 good measured steps (the bad run one step later)
    assert [e["step"] for e in bad.estimates] == [3]
    assert [e["step"] for e in never.estimates] == [2]
    for key in ("steps_used", "tau", "latency_mean", "latency_stddev"):
        assert bad.estimates[0][key] == never.estimates[0][key], key
    assert bad.estimates[0]["latency_mean"] == pytest.approx((1.0 + 1.5 + 2.0) / 3)
