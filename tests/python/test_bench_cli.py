# SPDX-License-Identifier: Apache-2.0
"""python -m gradcomp.bench: a user's model (module:function), a shapes file, the estimate's
arithmetic, DDP's bucket layout, and one clear line for each kind of bad input."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from gradcomp import bench

ONEBIT = ("onebit", "sign, L2 scale/128, rotated")  # the hook's default 1-bit plan
EXPECTED = {("allreduce", "plain fp32"), ("fp16", "cast"), ("bf16", "cast"), ("topk", "1%"),
            ("topk", "0.1%"), ("topk", "0.01%"), ("randomk", "1%"), ONEBIT,
            ("quant", "8 bits"), ("quant", "4 bits"), ("quant", "2 bits"),
            ("powersgd", "r=1"), ("powersgd", "r=2"), ("powersgd", "r=4"), ("powersgd", "r=8")}


def run_cli(args, cwd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "gradcomp.bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows_by_key(path):
    with open(path) as f:
        data = json.load(f)
    return data, {(r["compressor"], r["setting"]): r for r in data["rows"]}


def test_model_from_user_module(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "mymodel.py").write_text(textwrap.dedent("""
        import torch
        def make_model():
            return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(),
                                       torch.nn.Flatten(), torch.nn.Linear(16 * 14 * 14, 64),
                                       torch.nn.Linear(64, 10))
    """))
    out = tmp_path / "rows.json"
    r = run_cli(["--model", "mymodel:make_model", "--gbps", "10", "--world", "4", "--repeat", "1",
                 "--json", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data, rows = rows_by_key(out)
    n = 16 * 3 * 9 + 16 + 16 * 14 * 14 * 64 + 64 + 64 * 10 + 10
    assert data["parameters"] == n and data["tensors"] == 6 and data["world"] == 4
    assert set(rows) == EXPECTED
    assert rows[("fp16", "cast")]["ratio"] == pytest.approx(2.0)
    # each top-k density sends fewer bytes than the denser one
    assert (rows[("topk", "1%")]["bytes"] > rows[("topk", "0.1%")]["bytes"]
            > rows[("topk", "0.01%")]["bytes"])
    assert rows[("powersgd", "r=1")]["ratio"] > rows[("powersgd", "r=8")]["ratio"] > 1
    assert rows[("bf16", "cast")]["ratio"] == pytest.approx(2.0)
    # 1 bit and one fp32 scale per 128 values: 32 / (1 + 32 / 128) = 25.6x before headers
    assert 24 < rows[ONEBIT]["ratio"] <= 25.6
    # b bits per value plus an fp32 scale per 128-value block (the quant defaults), less a
    # chunk header
    for bits in (8, 4, 2):
        assert 0.95 * 32 / (bits + 32 / 128) < rows[("quant", f"{bits} bits")]["ratio"] \
            <= 32 / (bits + 32 / 128)
    plain = rows[("allreduce", "plain fp32")]
    # ring allreduce: 2 (P-1)/P of the buffer at 10 Gbit/s
    assert plain["comm_ms"] == pytest.approx(1e3 * 2 * 3 / 4 * 4 * n * 8 / 10e9)
    assert plain["vs_allreduce"] == pytest.approx(1.0)
    for row in data["rows"]:
        assert row["ms"] >= 0 and row["total_ms"] == pytest.approx(row["comm_ms"] + row["ms"])
    for key in EXPECTED:  # the printed table has every row
        assert f"| {key[0]} | {key[1]} |" in r.stdout
    assert "vs allreduce" in r.stdout


def test_shapes_file(tmp_path):
    shapes = {"conv": [64, 3, 7, 7], "bn": [64], "fc.weight": [1000, 512], "fc.bias": [1000],
              "scalar": []}
    p = tmp_path / "shapes.json"
    p.write_text(json.dumps(shapes))
    out = tmp_path / "rows.json"
    r = run_cli(["--shapes", str(p), "--repeat", "1", "--no-progress", "--json", str(out)],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data, rows = rows_by_key(out)
    assert data["parameters"] == 64 * 3 * 49 + 64 + 512000 + 1000 + 1
    assert set(rows) == EXPECTED
    assert "comm ms" not in r.stdout  # no --gbps, no estimate
    # a plain list of shapes and {"shapes": ...} give the same parameter count
    for form in (list(shapes.values()), {"shapes": list(shapes.values())}):
        p.write_text(json.dumps(form))
        assert bench.shapes_from_json(str(p))[1] == [tuple(s) for s in shapes.values()]


def test_link_bytes_and_estimate():
    B, D, P = 1000.0, 100000.0, 8
    assert bench.link_bytes("allreduce", B, D, P) == pytest.approx(2 * 7 / 8 * B)
    assert bench.link_bytes("two-phase", B, D, P) == pytest.approx(2 * 7 / 8 * B)
    assert bench.link_bytes("allgather", B, D, P) == pytest.approx(7 * B)
    # top-k's plan densifies when the allgather would move more than a dense allreduce
    assert bench.link_bytes("allgather", 50000.0, D, P) == pytest.approx(2 * 7 / 8 * D)
    assert bench.comm_seconds(1.25e9, 10) == pytest.approx(1.0)


def test_ddp_bucket_layout():
    MB = 1024 * 1024
    shapes = [(MB // 4,)] * 3 + [(10 * MB // 4,)] * 6  # 3 x 1 MiB, then 6 x 10 MiB
    b = bench.ddp_buckets(shapes, 25 * MB)
    # reverse order; the first bucket closes at 1 MiB, the next ones at 25 MiB
    assert b == [[8], [7, 6, 5], [4, 3, 2, 1, 0]]
    assert sum(len(x) for x in b) == len(shapes)


@pytest.mark.parametrize("args, message", [
    (["--model", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
    (["--model", "json:no_such_function"], "has no attribute 'no_such_function'"),
    (["--model", "json:dumps"], "calling dumps() failed"),
    (["--model", "justamodule"], "MODULE:CALLABLE"),
    (["--shapes", "missing.json"], "no such file"),
    (["--shapes", "bad.json"], "not valid JSON"),
    (["--shapes", "negative.json"], "must be a list of positive integers"),
    (["--shapes", "good.json", "--gbps", "0"], "--gbps must be positive"),
    (["--shapes", "good.json", "--gbps", "-1"], "--gbps must be positive"),
    (["--shapes", "good.json", "--gbps", "fast"], "--gbps must be a number"),
    (["--shapes", "good.json", "--gbps", "10", "--world", "1"], "--world must be at least 2"),
])
def test_bad_input_is_one_clear_error(tmp_path, args, message):
    if args[0] == "--model":
        pytest.importorskip("torch")
    (tmp_path / "bad.json").write_text("[[64, 3], [64")
    (tmp_path / "negative.json").write_text(json.dumps({"w": [64, -3]}))
    (tmp_path / "good.json").write_text(json.dumps([[8, 8]]))
    r = run_cli(args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_torchvision_model_when_importable(tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "rows.json"
    r = run_cli(["--model", "torchvision:resnet18", "--repeat", "1", "--no-progress",
                 "--json", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data, _ = rows_by_key(out)
    assert data["parameters"] == 11_689_512  # torchvision's resnet18
