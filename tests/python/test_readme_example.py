# SPDX-License-Identifier: Apache-2.0
"""The README's PyTorch example runs as written: its first ```python block, on 2 gloo ranks, with
a small model and loader where it leaves them to the reader. It must train in consensus, and its
"auto" hook must have measured and chosen a compressor per bucket."""
import os
import re

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ddp_util import free_port, mark_ok, params_equal_across_ranks, run_ok  # noqa: E402

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _example(containing: str = "") -> str:
    """The README's first ```python block (that contains `containing`)."""
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    blocks = [b for b in blocks if containing in b]
    assert blocks, f"the README has no PyTorch example with {containing!r}"
    return blocks[0]


def _run_example(rank, world, port, code, model_seed, batches):
    """Runs the example as a torchrun rank would, with a small model and loader; its globals."""
    dist.destroy_process_group()  # the example makes its own, from the environment (torchrun's)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    g = torch.Generator().manual_seed(rank)

    def make_model():
        torch.manual_seed(model_seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    loader = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
              for _ in range(batches)]
    env = {"make_model": make_model, "loader": loader}
    exec(compile(code, "README.md", "exec"), env)
    return env


def _worker(rank, world, out_dir, port, code):
    env = _run_example(rank, world, port, code, 0, 24)
    state, model = env["state"], env["model"]
    assert params_equal_across_ranks(model)
    assert state.iter == 24
    # 2 plain steps, then a trial of 4 candidates x 4 steps: the choice from step 18 on
    assert state.choices, "auto chose nothing in 24 steps"
    mark_ok(out_dir, rank)


def test_readme_pytorch_example_runs():
    code = _example()
    assert "gt.hook(" in code and "register_comm_hook" in code
    run_ok(_worker, 2, free_port(), code)


def _diloco_worker(rank, world, out_dir, port, code):
    # unlike replicas (seeded by rank): the averager starts every rank from rank 0's
    env = _run_example(rank, world, port, code, rank, 40)
    avg, model = env["avg"], env["model"]
    assert params_equal_across_ranks(model)
    assert avg.sync_steps == [16, 32, 40] and avg.wire_bytes > 0
    mark_ok(out_dir, rank)


def test_readme_diloco_example_runs():
    code = _example("gt.diloco(")
    run_ok(_diloco_worker, 2, free_port(), code)
