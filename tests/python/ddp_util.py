# SPDX-License-Identifier: Apache-2.0
"""Helpers for multi-process DDP tests: spawn N gloo ranks on loopback, deterministic models."""
import atexit
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

# The rank launcher is the experiments' (the clone's top-level package `experiments`, not in the
# wheel): its root on sys.path for the scripts that import this module outside pytest
# (hung_peer.py), as conftest.py puts it there for the tests.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
# (free_port, rank_context, start_ranks: for the tests that start ranks themselves)
from experiments.launch import (  # noqa: E402,F401
    exit_rank, free_port, rank_context, start_ranks)


def gpu_suite_device():
    """The device of a GPU suite and its module's pytestmark: GRADCOMP_TEST_DEVICE, "cuda" by
    default (the suite then skipped without a CUDA device or a gradcomp built with CUDA); "cpu"
    runs the suite's logic over gloo on the CPU, for a machine without a GPU."""
    import gradcomp
    import pytest

    dev = os.environ.get("GRADCOMP_TEST_DEVICE", "cuda")
    marks = []
    if dev == "cuda":
        marks.append(pytest.mark.skipif(
            not (torch.cuda.is_available() and gradcomp.built_with_cuda()),
            reason="needs a CUDA device and gradcomp built with CUDA"))
    return dev, marks


def _entry(rank, world, port, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        dist.barrier()
        dist.destroy_process_group()
        raise
    finish()


def finish():
    """Ends a spawned rank once every rank is done (see exit_rank: no interpreter teardown)."""
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def run(fn, world, *args):
    """Runs fn(rank, world, *args) in `world` new processes; raises if any rank fails.

    The ranks are forked from multiprocessing's fork server, which imports torch once
    (experiments.launch.start_ranks, which the experiments use too): starting a fresh
    interpreter that imports torch for every rank (mp.spawn) was most of these tests' time. Each
    rank still imports gradcomp and the test module itself; the server is started from the test
    process with its environment and output (pytest's capture), and forks only, so no rank
    inherits another's state. docs/MULTI_GPU.md's torchrun lines (test_torchrun_recipe.py) start
    fresh interpreters, as a user's job does."""
    start_ranks(_entry, (world, free_port(), fn, args), world)


class Net(torch.nn.Module):
    """A small MLP with an optional unused branch."""

    def __init__(self, d_in=32, d_hidden=64, d_out=8, unused=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_hidden)
        self.fc3 = torch.nn.Linear(d_hidden, d_out)
        self.unused = torch.nn.Linear(d_hidden, 3) if unused else None

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.fc3(h)


class EmbedNet(torch.nn.Module):
    """An embedding (sparse=True: a sparse gradient, in a DDP bucket of its own) and a linear
    layer; its input is a tensor of indices below 50."""

    def __init__(self, sparse=True):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=sparse)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, i):
        return self.fc(self.emb(i))


def make_data(rank, steps, batch=16, d_in=32, d_out=8, seed=0):
    """Per-rank regression data from a fixed teacher (same teacher on every rank)."""
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(d_in, d_out, generator=g)
    gr = torch.Generator().manual_seed(rank * 7919 + seed)
    xs = [torch.randn(batch, d_in, generator=gr) for _ in range(steps)]
    return [(x, x @ teacher) for x in xs]


def training_steps(model, opt, data):
    """train() one step at a time: yields after each backward(), while the step's gradients are
    in the parameters' .grad, and steps the optimizer when the caller asks for the next one."""
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        yield
        opt.step()


def train(model, opt, data):
    """One optimizer step per (x, y) of data on the MSE loss."""
    for _ in training_steps(model, opt, data):
        pass


def train_losses(model, opt, data, device=None):
    """train(), returning each step's loss (a float); each batch moved to `device` first when
    one is given."""
    losses = []
    for x, y in data:
        if device is not None:
            x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fails_twice(model, opt, batch, match: str) -> None:
    """backward() raises a ValueError matching `match` on this rank at two steps in a row (the
    step after a failed check checks again)."""
    import pytest

    x, y = batch
    for _ in range(2):
        opt.zero_grad()
        with pytest.raises(ValueError, match=match):
            torch.nn.functional.mse_loss(model(x), y).backward()


def params_equal_across_ranks(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


_BASE = None


def tmpdir():
    """A fresh directory for one test's ranks to write into. All of them live under one base
    directory per test process, removed when that process exits, so that a test session leaves
    nothing behind in /tmp (a full run makes over a thousand)."""
    global _BASE
    if _BASE is None:
        _BASE = tempfile.mkdtemp(prefix="gradcomp-tests-")
        owner = os.getpid()
        # only the process that made it removes it: spawned ranks import this module too
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(_BASE, ignore_errors=True))
    return tempfile.mkdtemp(prefix="t-", dir=_BASE)


def read_json(out_dir, name):
    """What the ranks wrote as JSON into `name` in out_dir (a test's tmpdir())."""
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def mark_ok(out_dir, rank):
    """A worker of run_ok() reached its end."""
    with open(os.path.join(out_dir, f"ok_{rank}"), "w") as f:
        f.write("ok")


def run_ok(fn, world, *args):
    """run(fn, world, out_dir, *args) and checks that every rank called mark_ok(out_dir, rank)
    (a rank that returned early or hung would not)."""
    out = tmpdir()
    run(fn, world, out, *args)
    assert sorted(os.listdir(out)) == [f"ok_{r}" for r in range(world)]


def assert_resumed_equals_straight(out_dir, world, what=""):
    """final_resume_<rank>.pt == final_straight_<rank>.pt, bitwise, for every rank: a job
    restored from a checkpoint continued exactly like the uninterrupted one."""
    for rank in range(world):
        a = torch.load(os.path.join(out_dir, f"final_resume_{rank}.pt"))
        b = torch.load(os.path.join(out_dir, f"final_straight_{rank}.pt"))
        for k in a:
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs after restore (rank {rank})"


def save_checkpoint(path, model, opt, state):
    """What a training job checkpoints with a gradcomp hook: the module, the optimizer and the
    hook's state (residuals, momenta, Q, errors), saved together."""
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, path)


def load_checkpoint(path, model, opt, state):
    """Restores save_checkpoint() into a freshly built DDP model, optimizer and hook state."""
    ck = torch.load(path)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
