# SPDX-License-Identifier: Apache-2.0
"""docs/MULTI_GPU.md's torchrun recipe runs as the document prints it: examples/train_ddp.py under
``python -m torch.distributed.run`` (torchrun's module form), on CPU over gloo: one node of 2
ranks with "auto", and two torchrun processes as two nodes of one rank each with top-k and
``--hierarchy node``. Each job must exit 0, lower its loss and end with bitwise identical
parameters on every rank; the lines run are the ones in the document's "Run by the test" block,
and that block holds no other line."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ddp_util import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "MULTI_GPU.md"
# s per job: 10-25 s on this 2-core machine, 95 s under a load average of 11; a hang never ends
JOB_TIMEOUT = 300

RUN = "python -m torch.distributed.run"
# torch 1.13's torchrun cannot parse its own --redirects/--tee defaults under Python 3.11
# (docs/MULTI_GPU.md, "torch 1.13 on Python 3.11"); 1 and 1 parse and keep stdout on the console
OLD_FIX = " --redirects=1 --tee=1"
ONE_NODE = "{run} --nproc_per_node=2{fix} examples/train_ddp.py --steps 20"
NODE = ("{run} --nnodes=2 --node_rank={n} --nproc_per_node=1 --master_addr=127.0.0.1{fix} "
        "examples/train_ddp.py --steps 20 --compressor topk --hierarchy node")


def _lines(old: bool):
    """The command lines this test runs on torch 1.13 (old) or 2.x: (one node, [node 0, node 1])."""
    fix = OLD_FIX if old else ""
    return (ONE_NODE.format(run=RUN, fix=fix),
            [NODE.format(run=RUN, n=n, fix=fix) for n in (0, 1)])


OLD = int(torch.__version__.split(".")[0]) < 2
ONE, TWO = _lines(OLD)


def _doc_block():
    """The command lines of the first code block under the heading "Run by the test"."""
    text = DOC.read_text()
    m = re.search(r"^## Run by the test\n.*?```bash\n(.*?)```", text, re.S | re.M)
    assert m, f"{DOC}: no ```bash block under '## Run by the test'"
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip()]


def test_the_doc_prints_exactly_the_lines_this_test_runs():
    one_new, two_new = _lines(old=False)
    one_old, two_old = _lines(old=True)
    assert _doc_block() == [one_new, *two_new, one_old, *two_old]


def _start(line, cwd, env, log):
    """Starts the line with this test's interpreter; its output goes to the file `log` (a pipe
    nobody reads while we wait could fill and stop the job)."""
    argv = shlex.split(line)
    assert argv[0] == "python"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable] + argv[1:], cwd=cwd, env=env, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    p.log = log
    return p


def _finish(procs):
    """Waits for the jobs (started together) up to JOB_TIMEOUT in all; returns
    [(exit code, output)]. At the timeout every job still running is stopped and says so."""
    deadline = time.monotonic() + JOB_TIMEOUT
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    late = [p for p in procs if p.poll() is None]
    for p in late:
        # SIGTERM: torchrun then stops its workers, which it starts in sessions of their own
        # (torch 2.x), where a signal to torchrun's process group would not reach them
        p.terminate()
    for p in late:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    out = []
    for p in procs:
        text = Path(p.log).read_text(errors="replace")
        if p in late:
            text += f"\n[test: stopped after {JOB_TIMEOUT} s]"
        out.append((p.returncode, text))
    return out


@pytest.fixture
def workdir(tmp_path):
    """A working directory where the doc's relative path examples/train_ddp.py resolves to the
    repository's script, and its checkpoint and torchrun's log folders land in tmp_path."""
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",  # the CPU/gloo branch, also on a machine with GPUs
        OMP_NUM_THREADS="1",  # 2 ranks on 2 cores; torchrun would set it too, with a warning
        TMPDIR=str(tmp_path),
        # torchrun reads --master_port from PET_MASTER_PORT: a free port instead of the default
        # 29500, which two CI jobs on one machine would share, without changing the line
        PET_MASTER_PORT=str(free_port()),
        # how often torchrun looks whether its workers ended: torch 1.13 waits 5 s (2.x 0.1 s)
        PET_MONITOR_INTERVAL="0.5",
    )
    return tmp_path, env


def _check(code, text, world):
    assert code == 0, f"exit {code}:\n{text[-6000:]}"
    first = re.search(r"step 1 loss ([0-9.]+)", text)
    final = re.search(r"final loss ([0-9.]+)", text)
    assert first and final, text[-6000:]
    assert float(final.group(1)) < float(first.group(1)), text[-3000:]
    assert f"parameters bitwise identical on all {world} ranks: True" in text, text[-3000:]


def _check_checkpoint(path, world):
    ck = torch.load(str(path))
    assert ck["step"] == 20 and set(ck) == {"model", "optimizer", "hook", "step"}
    # every rank's hook state, gathered on rank 0 (gt.gather_state_dict)
    assert ck["hook"]["world_size"] == world and len(ck["hook"]["ranks"]) == world


def test_one_node_auto(workdir):
    cwd, env = workdir
    ((code, text),) = _finish([_start(ONE, cwd, env, cwd / "job.log")])
    _check(code, text, 2)
    assert "auto chose {" in text, text[-3000:]
    _check_checkpoint(cwd / "train_ddp.pt", 2)


def test_two_nodes_topk_hierarchy(workdir):
    cwd, env = workdir
    (code0, text0), (code1, text1) = _finish([_start(line, cwd, env, cwd / f"node{n}.log")
                                              for n, line in enumerate(TWO)])
    assert code1 == 0, f"node 1 exited with {code1}:\n{text1[-4000:]}\nnode 0:\n{text0[-4000:]}"
    _check(code0, text0, 2)  # node 0 runs rank 0, which prints
    _check_checkpoint(cwd / "train_ddp.pt", 2)
