# SPDX-License-Identifier: Apache-2.0
"""The Fashion-MNIST experiment's machinery: configuration parsing, the PyTorch
baselines, the slow rank with and without DropCompute, the report (time to target, speedups,
CSV, table, plots) and the loader errors. Accuracy itself: test_training_accuracy.py."""
import csv
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

from experiments import baselines  # noqa: E402
from experiments import fashion_mnist as fm  # noqa: E402


def test_config_parsing_and_flags():
    assert fm.parse_config("topk+slow+dropcompute")[1] == "topk"
    assert fm.config_flags("topk+slow+dropcompute") == ("slow", "dropcompute")
    assert fm.config_flags("plain") == ()
    name, hook, opts, mc = fm.parse_config("onebit:block_size=64;scaling=sign_l2+slow")
    assert (hook, opts, mc) == ("onebit", {"block_size": 64, "scaling": "sign_l2"}, False)
    with pytest.raises(ValueError, match="unknown suffix"):
        fm.config_flags("topk+fast")
    with pytest.raises(ValueError, match=r"\+slow\+dropcompute"):
        fm.config_flags("topk+dropcompute")
    with pytest.raises(ValueError, match="unknown configuration"):
        fm.parse_config("topq")
    with pytest.raises(ValueError, match="unknown PyTorch baseline"):
        baselines.register("torch-int8", None)


def test_models_and_their_classifier_sizes():
    """The model variants: parameter counts, and the classifier (last layer) on either side of
    random-k's default dense_below (32768): sent whole on 'wide', sampled on 'wide4096'."""
    want = {"cnn": (824_458, 2_570), "wide": (6_463_882, 20_490), "wide4096": (12_908_938, 40_970)}
    for kind, (params, classifier) in want.items():
        m = fm.make_model(kind)
        assert sum(p.numel() for p in m.parameters()) == params, kind
        assert sum(p.numel() for p in m[-1].parameters()) == classifier, kind
    with pytest.raises(KeyError):
        fm.make_model("huge")


def test_vit_shapes_and_parameters():
    """The transformer workload: 1.2M parameters (1,199,882 counted by hand: per block 4 w^2 + 4 w
    attention, 8 w^2 + 5 w MLP, 4 w LayerNorms; w = 128, 6 blocks, plus the patch embedding,
    class token, 17 positions, final LayerNorm and head), logits for a batch, gradients
    everywhere."""
    w, d = 128, 6
    by_hand = d * (12 * w * w + 13 * w) + (49 * w + w) + w + 17 * w + 2 * w + (10 * w + 10)
    m = fm.make_model("vit")
    assert sum(p.numel() for p in m.parameters()) == by_hand == 1_199_882
    x = torch.randn(3, 1, 28, 28)
    out = m(x)
    assert out.shape == (3, 10)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    # one image's logits do not depend on the others in the batch (no mixing across samples)
    assert torch.allclose(m(x[:1]), out[:1], atol=1e-5)


def test_adamw_schedule_and_the_hooks_momentum():
    """AdamW: linear warm-up to the full rate, cosine decay to 0 at the last step, decoupled
    weight decay; SGD keeps its constant rate; a hook's momentum (an SGD scheme) is refused with
    AdamW, naming what to use instead."""
    from experiments.train import make_optimizer

    p = [torch.nn.Parameter(torch.ones(3))]
    args = dict(config="plain", lr=1e-3, optimizer="adamw", weight_decay=0.05, warmup_steps=10)
    opt, f = make_optimizer(p, args, False, total_steps=110)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.05
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.5)
    assert f(109) == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert f(110) == pytest.approx(0.0, abs=1e-12) and f(500) == pytest.approx(0.0, abs=1e-12)
    opt, f = make_optimizer(p, dict(config="plain", lr=0.05, momentum=0.9), False, 100)
    assert isinstance(opt, torch.optim.SGD) and f(0) == f(99) == 1.0
    assert opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="topk-ef"):
        make_optimizer(p, dict(args, config="topk"), True, 100)
    assert fm.parse_config("topk-ef")[1:] == ("topk", {"ratio": 0.001}, False)


def test_local_adamw_with_qsr_and_a_constant_period():
    """Local AdamW in the experiment: no DDP, the replicas averaged by QSRAverager. The constant
    period (alpha = 0) averages every h_base steps; QSR's period grows as the cosine schedule
    decays (never below h_base, h_base during the warm-up) and ends with an averaging at the last
    step; the wire bytes are one ring allreduce of the parameters per averaging."""
    base = dict(seed=0, lr=1e-3, momentum=0.0, batch=32, epochs=1, steps=40, model="cnn",
                train_subset=2560, test_subset=500, log_every=8, eval_every=0,
                optimizer="adamw", weight_decay=0.05, warmup_steps=4)
    const = fm.run_config(dict(base, config="local-h4"), world=2)
    assert const["sync_steps"] == list(range(4, 41, 4))
    dense_wire = const["plain_wire_bytes_per_step"]
    assert const["wire_bytes_per_step"] == pytest.approx(dense_wire * 10 / 40)
    assert const["accuracy"] > 0.5
    qsr = fm.run_config(dict(base, config="qsr:alpha=0.004;h_base=2"), world=2)
    s = qsr["sync_steps"]
    gaps = [b - a for a, b in zip([0] + s, s)]
    assert s[-1] == 40 and all(g >= 2 for g in gaps)
    assert gaps[:2] == [2, 2]  # the warm-up
    assert max(gaps[:-1]) > 2  # the period grew as the rate decayed
    assert qsr["wire_bytes_per_step"] == pytest.approx(dense_wire * len(s) / 40)


def test_diloco_configuration():
    """DiLoCo in the experiment: local AdamW replicas with an outer Nesterov step every 4 steps,
    the pseudo-gradient in 4-bit blocks, streamed in two fragments merged a step late. It trains,
    and its wire bytes are what the averager counted: far below one 4-bit exchange of the
    parameters per step (a quarter of the steps, eight times fewer bytes than fp32)."""
    base = dict(seed=0, lr=1e-3, momentum=0.0, batch=32, epochs=1, steps=40, model="cnn",
                train_subset=2560, test_subset=500, log_every=8, eval_every=0,
                optimizer="adamw", weight_decay=0.05, warmup_steps=4)
    r = fm.run_config(dict(base, config="qsr:alpha=0;h_base=4;outer=nesterov;fragments=2;"
                                        "delay=1;compressor=quant;bits=4"), world=2)
    assert r["sync_steps"] == list(range(4, 41, 4))
    assert r["accuracy"] > 0.5
    dense_wire = r["plain_wire_bytes_per_step"]
    # measured 2026-11-28: 1.7% of plain DDP's bytes per step at H = 8 (54,774 of 3,297,832)
    assert 0 < r["wire_bytes_per_step"] < dense_wire / 4 / 6
    with pytest.raises(Exception, match="unknown QSRAverager options"):  # raised in the rank
        fm.run_config(dict(base, config="qsr:alpha=0;h_base=4;outer=nesterov;bits=4"), world=1)


def test_onebit_adam_configuration():
    """1-bit Adam in the experiment: OneBitAdam with hook("onebit", adam=opt), the variance
    frozen after 30% of the steps; it trains, and the bytes per step drop after the freeze."""
    base = dict(config="onebit-adam", seed=0, lr=1e-3, momentum=0.0, batch=32, epochs=1,
                steps=40, model="cnn", train_subset=2560, test_subset=500, log_every=8,
                eval_every=0, optimizer="adamw", weight_decay=0.05, warmup_steps=4)
    r = fm.run_config(base, world=2)
    assert r["freeze_step"] == 12 and r["accuracy"] > 0.5
    wire = [w for _, _, _, w in r["steps_log"]]
    assert min(wire[:12]) > 20 * max(wire[13:])
    with pytest.raises(Exception, match="adamw"):
        fm.run_config(dict(base, optimizer="sgd", lr=0.05), world=2)


def test_baseline_bytes():
    m = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))
    n = sum(p.numel() for p in m.parameters())
    assert baselines.bytes_per_step("ddp", m) == 4 * n
    assert baselines.bytes_per_step("torch-fp16", m) == 2 * n
    assert baselines.bytes_per_step("no-comm", m) == 0
    assert baselines.bytes_per_step("sync-floor", m) == 0
    # rank 4: 100x50 is compressed to (50 + 100) 4 floats; 50x2 is not worth it (2 < 2x);
    # the biases travel as they are
    assert baselines.bytes_per_step("torch-powersgd", m, {"rank": 4}) == \
        4 * ((50 + 100) * 4 + 50 + 2 * 50 + 2)


def _floor_hooks_rank(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_util import Net

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    local = Net()
    torch.nn.functional.mse_loss(local(x), torch.zeros(8, 8)).backward()
    for kind in ("no-comm", "sync-floor"):
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)  # several buckets
        baselines.register(kind, model)
        for _ in range(2):  # the second step runs on DDP's rebuilt buckets
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), torch.zeros(8, 8)).backward()
        # every bucket comes back as this rank computed it: nothing averaged
        for p, q in zip(model.module.parameters(), local.parameters()):
            assert torch.equal(p.grad, q.grad), kind
    with open(os.path.join(out_dir, f"ok{rank}"), "w"):
        pass


def test_floor_hooks_leave_each_ranks_gradient_untouched(tmp_path):
    """The compute-floor baselines of ddp_hooks_bench: "no-comm" and "sync-floor" (one 1-element
    allreduce per bucket) return every bucket as the rank computed it, on 2 ranks with different
    data and several buckets; sync-floor's allreduce completes on both ranks."""
    import ddp_util

    ddp_util.run(_floor_hooks_rank, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


def _fake(config, times_accs, steps=100, spe=50, seed=0, wire=1000.0):
    return {"config": config, "seed": seed, "steps": steps, "steps_per_epoch": spe,
            "accuracy": times_accs[-1][2], "wall_s": times_accs[-1][1], "params": 10,
            "accuracy_log": times_accs, "wire_bytes_per_step": wire,
            "plain_wire_bytes_per_step": 3000.0, "samples_fraction": 1.0,
            "steps_log": [(0, 0.1, 2.3, wire), (1, 0.2, 2.2, wire)]}


def test_report_time_to_target_and_speedups(tmp_path):
    res = [
        _fake("plain", [(50, 10.0, 0.70), (100, 20.0, 0.86)], wire=3000.0),
        _fake("plain", [(50, 12.0, 0.84), (100, 24.0, 0.87)], seed=1, wire=3000.0),
        _fake("fp16", [(50, 5.0, 0.86), (100, 10.0, 0.87)]),
        _fake("torch-fp16", [(50, 15.0, 0.85), (100, 30.0, 0.86)]),
        _fake("topk+slow", [(50, 8.0, 0.80), (100, 16.0, 0.855)]),
        _fake("topk+slow+dropcompute", [(50, 6.0, 0.80), (100, 12.0, 0.851)]),
        _fake("onebit", [(50, 4.0, 0.70), (100, 8.0, 0.80)]),
    ]
    assert fm.time_to_target(res[0], 0.85) == 20.0
    assert fm.time_to_target(res[6], 0.85) is None
    # smoothed: the mean of the last evaluations must reach the target, not one grazing point
    graze = _fake("x", [(25, 5.0, 0.86), (50, 10.0, 0.80), (75, 15.0, 0.84), (100, 20.0, 0.87),
                        (125, 25.0, 0.87)])
    assert fm.time_to_target(graze, 0.85) == 5.0
    assert fm.time_to_target(graze, 0.85, window=3) == 25.0  # (0.84 + 0.87 + 0.87) / 3
    assert fm.time_to_target(graze, 0.87, window=3) is None
    rows = {r["config"]: r for r in fm.summarize(res, 0.85)}
    assert rows["plain"]["time_to_target"] == pytest.approx(22.0)  # 20 and 24 over two seeds
    assert rows["plain"]["accuracy"] == pytest.approx(0.865)
    assert rows["fp16"]["speedup_vs_plain"] == pytest.approx(22.0 / 5.0)
    assert rows["fp16"]["speedup_vs_torch"] == pytest.approx(15.0 / 5.0)
    assert rows["topk+slow+dropcompute"]["speedup_vs_no_dropcompute"] == pytest.approx(16 / 12)
    assert rows["onebit"]["time_to_target"] is None and rows["onebit"]["speedup_vs_plain"] is None
    # two evaluations: no 3-evaluation mean exists, so no smoothed time
    assert rows["plain"]["time_to_target_smoothed"] is None
    meta = dict(model="cnn", world=4, link="loopback", date="2026-11-24", commit="abc",
                torch="x", command="cmd", load_before=1.0, load_after=2.0, wall_s=3.0,
                lr=0.05, momentum=0.9, batch=32, eval_every=50)
    fm.write_report(res, str(tmp_path), 0.85, meta,
                    failed=[{"config": "randomk", "seed": 0, "error": "non-finite gradient"}])
    table = (tmp_path / "table.md").read_text()
    assert "| fp16 | 87.00% (87.00) | +0.50 |" in table
    assert "| onebit |" in table and "not reached" in table
    assert "4.40x" in table and "3.00x" in table and "1.33x" in table
    assert "randomk (seed 0) did not finish: non-finite gradient" in table
    with open(tmp_path / "evals.csv") as f:
        ev = list(csv.DictReader(f))
    assert len(ev) == 14 and ev[0]["epoch"] == "1.0000" and ev[0]["test_accuracy"] == "0.7000"
    with open(tmp_path / "steps.csv") as f:
        assert len(list(csv.DictReader(f))) == 14
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[-1])["error"] == "non-finite gradient"
    for png in ("accuracy_vs_time.png", "accuracy_vs_epoch.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_runs():
    """A few steps of the configurations the unit tests above do not train: PyTorch's hooks
    and the slow rank with and without DropCompute (2 ranks, loopback)."""
    out = {}
    for cfg in ("torch-fp16", "torch-powersgd", "topk+slow", "topk+slow+dropcompute"):
        args = dict(config=cfg, seed=0, lr=0.05, momentum=0.9, batch=32, epochs=1, steps=24,
                    model="cnn", train_subset=2048, test_subset=500, log_every=8, eval_every=8,
                    micro_batches=4, slow_base_ms=2.0, slow_log_mu=math.log(2.0),
                    slow_log_sigma=2.0, slow_cap_ms=40.0)
        out[cfg] = fm.run_config(args, world=2)
    return out


def test_baselines_and_slow_rank_runs_train_and_log(tiny_runs):
    for cfg, r in tiny_runs.items():
        assert r["steps"] == 24, cfg
        assert [s for s, _, _ in r["accuracy_log"]] == [8, 16, 24], cfg
        times = [t for _, t, _ in r["accuracy_log"]]
        assert times == sorted(times) and times[0] > 0, cfg
        assert len(r["steps_log"]) == 24 and all(math.isfinite(x[2]) for x in r["steps_log"])
        assert r["accuracy"] > 0.3, (cfg, r["accuracy"])  # 24 steps: well above chance (0.1)
    assert tiny_runs["torch-fp16"]["wire_bytes_per_step"] == \
        pytest.approx(tiny_runs["torch-fp16"]["plain_wire_bytes_per_step"] / 2)
    assert tiny_runs["torch-powersgd"]["wire_bytes_per_step"] < \
        tiny_runs["torch-powersgd"]["plain_wire_bytes_per_step"] / 10
    slow, dc = tiny_runs["topk+slow"], tiny_runs["topk+slow+dropcompute"]
    assert slow["micro_batches"] == 4 and slow["dropcompute_tau"] is None
    assert slow["samples_fraction_per_rank"] == [1.0, 1.0]
    assert dc["dropcompute_tau"] is not None and dc["dropcompute_tau"] > 0
    assert dc["samples_fraction_per_rank"][0] <= 1.0


def test_from_results_writes_a_report(tmp_path, tiny_runs):
    path = tmp_path / "runs.jsonl"
    with open(path, "w") as f:
        for r in tiny_runs.values():
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "report"
    assert fm.main(["--from-results", str(path), "--report", str(out), "--target", "0.3"]) == 0
    table = (out / "table.md").read_text()
    for cfg in tiny_runs:
        assert f"| {cfg} |" in table
    assert (out / "meta.json").exists() and (out / "accuracy_vs_time.png").exists()


def test_report_setting_comes_from_the_runs():
    """--from-results labels the report with what the runs recorded, not the command's defaults
    (a report of wide-model runs once said "cnn, loopback"); differing runs are marked mixed, and
    a key no run recorded takes the command's value."""
    runs = [dict(model="wide", world=4, lr=0.05, link="links of 1gbit (network namespaces)"),
            dict(model="wide", world=4, lr=0.1, link="links of 1gbit (network namespaces)")]
    s = fm.setting_of(runs, {"model": "cnn", "link": "loopback", "eval_every": 25, "batch": 32})
    assert s["model"] == "wide" and s["world"] == 4
    assert s["link"] == "links of 1gbit (network namespaces)"
    assert s["lr"] == "mixed: 0.05 / 0.1"
    assert s["eval_every"] == 25 and s["batch"] == 32  # not recorded by these runs
    assert "momentum" not in s
    assert fm.setting_of([dict(model="cnn")], {})["model"] == "cnn"


def test_a_failing_configuration_is_recorded_and_the_others_still_run(tmp_path):
    """Without --report, a configuration that fails (here: an invalid hook option, raised in the
    ranks) is printed, written to --out with its error, the next configuration still trains, and
    the exit status is 1."""
    out = tmp_path / "runs.jsonl"
    rc = fm.main(["--configs", "topk:ratio=2,plain", "--seeds", "0", "--world", "2", "--steps", "4",
                  "--train-subset", "256", "--test-subset", "100", "--out", str(out)])
    assert rc == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["config"] for r in rows] == ["plain", "topk:ratio=2"]
    assert rows[0]["steps"] == 4 and "error" not in rows[0]
    assert "ratio" in rows[1]["error"] and "\n" not in rows[1]["error"], rows[1]["error"]


def _sweep_module():
    from experiments import auto_sweep

    return auto_sweep


def test_every_sweep_method_is_a_bench_configuration_and_the_ab_variants_differ():
    """What the sweep asks the bench for exists there (an unknown name would run nothing), and
    the A/B variant of auto without fp16's ring route builds auto's candidate list without it,
    leaving the module's list as it was; the one with the earlier cost rule has it."""
    from experiments import ddp_hooks_bench as bench
    from gradcomp.torch import _auto

    sw = _sweep_module()
    names = {c[0] for c in bench.SWEEP_CONFIGS}
    assert set(sw.METHODS + sw.AB_METHODS) <= names, set(sw.METHODS + sw.AB_METHODS) - names

    class _Model(torch.nn.Linear):  # what _setup registers the hook on, without a DDP
        def __init__(self):
            super().__init__(4, 4)

        def register_comm_hook(self, state, hook):
            self.state = state

    # (_gather: as on gloo with more than 2 ranks, where the route candidates exist)
    opts = dict(next(c[2] for c in bench.SWEEP_CONFIGS if c[0] == "auto-noring"), _gather=True)
    m = _Model()
    state = bench._setup("auto", opts, m)
    assert state is m.state
    assert state.candidates == ["allreduce", "fp16", "fp16/gather", "quant", "quant/gather",
                                "powersgd"]
    assert _auto._RING_ROUTED == ("fp16",)
    full = bench._setup("auto", {"_gather": True}, _Model())
    assert "fp16/allreduce" in full.candidates and full._skew_free
    mean = bench._setup("auto", dict(next(c[2] for c in bench.SWEEP_CONFIGS
                                          if c[0] == "auto-meancost")), _Model())
    assert not mean._skew_free
    # the ring-sum variants set the driver's small-allreduce threshold for their own steps, and
    # the next configuration sets it back
    from gradcomp.torch import _driver
    default = _driver.P2P_ALLREDUCE_BYTES
    assert default > 0
    ring = bench._setup("powersgd", dict(next(c[2] for c in bench.SWEEP_CONFIGS
                                              if c[0] == "powersgd-ringsums")), _Model())
    assert _driver.P2P_ALLREDUCE_BYTES == 0 and ring.compressor == "powersgd"
    bench._setup("ddp", {}, _Model())
    assert _driver.P2P_ALLREDUCE_BYTES == default
    for s in (state, full, mean, ring):
        s.close()


def _sweep_run(rounds_ms, choices=None):
    """A fake bench result: method -> each round's median step time in ms."""
    rows = [{"name": n, "all_rounds": [t / 1e3 for t in ts],
             "choices": choices if n == "auto" else None} for n, ts in rounds_ms.items()]
    meta = {"date": "2026-11-28T00:00:00+00:00", "commit": "abc1234", "dirty": False,
            "torch": "2.x", "cpus": 2, "load_min": 1.0, "load_max": 2.0, "command": "x"}
    return {"meta": meta, "rows": rows}


def test_auto_sweep_analysis_and_report(tmp_path):
    """The sweep's reading of one setting: speeds from the median of the rounds, a loss only
    below 0.95x with the rounds' ranges apart, the communication share from the compute floor,
    the best method and the regret; the report and heatmaps from the files in a folder; the
    settings' order (fastest link first) and their keys."""
    sw = _sweep_module()
    base = {"ddp": [100, 110], "no-comm": [20, 20], "torch-fp16": [80, 80],
            "torch-powersgd": [60, 64], "fp16": [75, 75], "onebit": [40, 40]}
    # auto at 0.5 of plain DDP's speed, rounds far apart: a loss
    slow = sw.analyse(_sweep_run(dict(base, auto=[210, 210]), {"0": "powersgd"}))
    assert slow["loss"] and slow["vs_ddp"] == pytest.approx(105 / 210)
    assert slow["comm_share"] == pytest.approx(1 - 20 / 105)
    # the most a method exchanging once per step can reach: DDP's step over the floor plus one
    # one-way latency (RTT / 2); no bound without the setting's RTT
    assert slow["bound"] is None
    bounded = sw.analyse(_sweep_run(dict(base, auto=[210, 210])), 50.0)
    assert bounded["bound"] == pytest.approx(105 / (20 + 25))
    assert bounded["vs_bound"] == pytest.approx((105 / 210) / (105 / 45))
    assert slow["best"] == "onebit" and slow["best_vs_ddp"] == pytest.approx(105 / 40)
    assert slow["vs_best"] == pytest.approx(40 / 210)
    # the best without the families that need DGC's momentum correction: PyTorch's PowerSGD
    assert slow["best_plain"] == "torch-powersgd"
    assert slow["vs_best_plain"] == pytest.approx(62 / 210)
    # below 0.95x but within the rounds' spread: not a loss
    close = sw.analyse(_sweep_run(dict(base, ddp=[100, 130], auto=[122, 128])))
    assert close["vs_ddp"] < 0.95 and not close["loss"]
    # behind PyTorch's hooks only beyond the rounds' spread: PowerSGD's [60, 64] against auto's
    # [210, 210] is; fp16's [80, 80] against auto's [79, 83] is not, though slower by the median
    assert slow["behind"] == ["torch-fp16", "torch-powersgd"]
    assert sw.analyse(_sweep_run(dict(base, auto=[79, 83])))["behind"] == ["torch-powersgd"]
    fast = sw.analyse(_sweep_run(dict(base, auto=[30, 30]), {"0": "powersgd", "1": "allreduce"}))
    assert fast["best"] == "auto" and fast["vs_best"] == 1.0 and not fast["loss"]
    assert fast["vs_torch_fp16"] == pytest.approx(80 / 30)
    keys = [s["key"] for s in sw.settings(["mlp"], [2], ["100mbit", "40gbit"], [0.1, 50.0])]
    assert keys == ["mlp_w2_40gbit_rtt0.1ms", "mlp_w2_40gbit_rtt50ms",
                    "mlp_w2_100mbit_rtt0.1ms", "mlp_w2_100mbit_rtt50ms"]
    with pytest.raises(ValueError, match="rate '1tbyte'"):
        sw._rate_bits("1tbyte")
    for key, run in (("cnn_w2_40gbit_rtt0.1ms", _sweep_run(dict(base, auto=[30, 30]))),
                     ("cnn_w4_100mbit_rtt50ms", _sweep_run(dict(base, auto=[210, 210])))):
        with open(tmp_path / f"{key}.json", "w") as f:
            json.dump(run, f)
    text = sw.report(str(tmp_path))
    assert "2 of 72 settings" in text
    assert "auto >= 0.95x plain DDP: 1 of 2 settings (losses: cnn_w4_100mbit_rtt50ms)" in text
    assert "auto within 10% of the best method: 1 of 2; of the best method without" in text
    assert ("auto >= PyTorch's fp16 hook: 1 of 2; below it beyond the rounds' spread: 1 "
            "(cnn_w4_100mbit_rtt50ms 0.38)") in text
    # both settings communicate 81% of DDP's step; the bounds (105 / 20.05 and 105 / 45 ms) leave
    # 2x open, and auto reached it in the faster one (3.5x)
    assert "(2 settings): auto >= 2x in 1;" in text and "bound is below 2x" not in text
    # a sweep in parts: a second folder adds the settings the first lacks, and says so
    other = tmp_path / "other"
    other.mkdir()
    heavy = dict(base, ddp=[100, 100], **{"no-comm": [40, 40]}, auto=[60, 60])
    for key, run in (("cnn_w2_40gbit_rtt0.1ms", _sweep_run(dict(base, auto=[500, 500]))),
                     ("mlp_w2_1gbit_rtt50ms", _sweep_run(heavy))):
        with open(other / f"{key}.json", "w") as f:
            json.dump(run, f)
    # an A/B of auto's mechanism: its variants are shown, never the "best" method, and a run
    # without PyTorch's hooks reports none for them
    ab = {"ddp": [100, 100], "no-comm": [40, 40], "auto": [90, 90], "auto-step0": [20, 20],
          "quant-2phase": [10, 10]}
    abr = sw.analyse(_sweep_run(ab, {"0": "allreduce"}), 0.1)
    assert abr["best"] == "auto" and abr["speeds"]["auto-step0"] == pytest.approx(5.0)
    # a fixed family's variant (quant by one route) has a speed, and no choices to show
    assert abr["speeds"]["quant-2phase"] == pytest.approx(10.0)
    assert set(abr["ab_choices"]) == {"auto-step0"}
    assert abr["vs_torch_fp16"] is None
    ab_dir = tmp_path / "ab"
    ab_dir.mkdir()
    run = _sweep_run({k: v for k, v in ab.items() if k != "quant-2phase"}, {"0": "allreduce"})
    run["rows"][-1]["choices"] = {"0": "fp16"}  # (auto-step0's row)
    with open(ab_dir / "vit_w2_40gbit_rtt0.1ms.json", "w") as f:
        json.dump(run, f)
    text = sw.report(str(ab_dir))
    assert "| vit_w2_40gbit_rtt0.1ms | 0:allreduce | 0:fp16 |" in text
    assert "PyTorch's fp16 hook" not in text and "| setting | auto | auto-step0 |" in text
    # every round's own trial and choice: auto's two rounds disagree, auto-step0's agree
    rows = {r["name"]: r for r in run["rows"]}
    rows["auto"]["all_trials"] = [{"choices": {"0": "allreduce"}}, {"choices": {"0": "fp16"}}]
    rows["auto-step0"]["all_trials"] = [{"choices": {"0": "fp16"}}, {"choices": {"0": "fp16"}}]
    with open(ab_dir / "vit_w2_40gbit_rtt0.1ms.json", "w") as f:
        json.dump(run, f)
    text = sw.report(str(ab_dir))
    assert "Settings whose rounds all chose alike: auto: 0 of 1; auto-step0: 1 of 1." in text
    assert "| vit_w2_40gbit_rtt0.1ms | 0:allreduce / 0:fp16 | 0:fp16 / 0:fp16 |" in text
    with pytest.raises(SystemExit, match="--methods: unknown 'auto-bogus'"):
        sw.main(["--methods", "ddp,auto-bogus", "--out", str(tmp_path / "none")])
    both = sw.load(str(tmp_path), [str(other)])
    assert [(r["key"], os.path.basename(r["folder"])) for r in both] == [
        ("mlp_w2_1gbit_rtt50ms", "other"), ("cnn_w2_40gbit_rtt0.1ms", tmp_path.name),
        ("cnn_w4_100mbit_rtt50ms", tmp_path.name)]
    text = sw.report(str(tmp_path), [str(other)])
    assert "3 of 72 settings" in text and "Settings from several runs: 2 from" in text
    # the MLP setting: 60% communication, a bound of 100 / (40 + 25) ms = 1.54x below 2x
    assert "(3 settings): auto >= 2x in 1;" in text
    assert "In 1 of them the bound is below 2x" in text and "mlp_w2_1gbit_rtt50ms 1.54x" in text
    assert "in the other 2: auto >= 2x in 1." in text
    pytest.importorskip("matplotlib")
    paths = sw.heatmaps(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["heatmap_cnn.png"]
    assert os.path.getsize(paths[0]) > 10_000
