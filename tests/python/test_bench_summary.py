# SPDX-License-Identifier: Apache-2.0
"""bench/summarize.py (the main job's summary) on the Google Benchmark JSON of a committed run:
one row per compressor setting and size, plain numbers (no rate suffixes), the 4-rank speedups,
and a plain statement when bench_comm ran one rank."""
import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = os.path.join(ROOT, "bench", "results", "2026-11-27-b37bad8")
SUMMARIZE = os.path.join(ROOT, "bench", "summarize.py")


def summarize(d):
    return subprocess.run([sys.executable, SUMMARIZE, d, "--no-plot"], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def run_dir(tmp_path):
    if not os.path.isdir(RUN):
        pytest.skip("the committed bench run is not in this checkout")
    for f in os.listdir(RUN):
        if f.endswith(".json"):
            shutil.copy(os.path.join(RUN, f), tmp_path / f)
    return tmp_path


def test_summary_of_a_four_rank_run(run_dir):
    r = summarize(str(run_dir))
    assert r.returncode == 0, r.stderr
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    keys = {(x["compressor"], x["setting"], x["elements"]) for x in rows}
    assert ("topk", "0.1%", "25000000") in keys
    assert ("onebit", "sign L2", "25000000") in keys
    assert ("powersgd", "r=4, ResNet-50", "25557032") in keys
    assert ("randomk", "1%", "25000000") in keys  # comm-only row
    for bits in (8, 4, 2):  # the multi-bit codec, its ratio from the encoder's statistics
        q = next(x for x in rows if x["compressor"] == "quant" and x["setting"] == f"{bits} bits"
                 and x["elements"] == "25000000")
        assert 0.95 * 32 / (bits + 32 / 128) < float(q["ratio"]) <= 32 / (bits + 32 / 128)
    q4 = next(x for x in rows if x["compressor"] == "quant" and x["setting"] == "4 bits"
              and x["elements"] == "25000000")
    assert float(q4["step_ms"]) > 0 and float(q4["decode_ms"]) > 0  # bench_comm's case, decode
    for x in rows:  # every ratio and speedup is a plain positive number
        for c in ("ratio", "speedup", "frac_of_memcpy", "vs_plain"):
            if x[c]:
                assert float(x[c]) > 0, (c, x)
    topk = next(x for x in rows if x["compressor"] == "topk" and x["setting"] == "0.1%"
                and x["elements"] == "25000000")
    assert float(topk["ratio"]) > 600 and float(topk["vs_plain"]) > 1
    assert "step ms (4 ranks)" in r.stdout
    assert "/s" not in r.stdout.split("\n")[2]  # no rate suffix in the table's cells
    assert "4 MPI ranks" in r.stdout


def test_one_rank_run_says_no_communication(run_dir):
    with open(run_dir / "bench_comm.json") as f:
        data = json.load(f)
    data["context"]["comm_ranks"] = "1"
    with open(run_dir / "bench_comm.json", "w") as f:
        json.dump(data, f)
    r = summarize(str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "ONE rank: nothing is communicated" in r.stdout
    with open(run_dir / "summary.csv") as f:
        assert all(not x["vs_plain"] for x in csv.DictReader(f))


def test_cut_off_json_is_left_out(run_dir):
    (run_dir / "bench_topk.json").write_text('{"benchmarks": [')
    r = summarize(str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "bench_topk.json is not valid JSON" in r.stderr
    assert "| onebit |" in r.stdout
