# SPDX-License-Identifier: Apache-2.0
"""The DDP hooks under failure (issue 11): bad options are refused when the hook is made, and a
worker-thread error reaches the user with its own type and message."""
import math

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402
from gradcomp.torch._driver import Worker  # noqa: E402

from ddp_util import Net, make_data, params_equal_across_ranks, run  # noqa: E402

# ---- options are validated by gt.hook(), with the C++ rules ------------------------------------
BAD_OPTIONS = [
    ("topk", dict(ratio=0)),
    ("topk", dict(ratio=2)),
    ("topk", dict(ratio=math.nan)),
    ("topk", dict(ratio="big")),
    ("topk", dict(momentum=1.5)),
    ("topk", dict(momentum=-0.1)),
    ("topk", dict(clip_norm=-1)),
    ("topk", dict(warmup_steps=-1)),
    ("topk", dict(warmup_ratios=[0.5], warmup_steps=0)),
    ("topk", dict(warmup_ratios=[2.0], warmup_steps=10)),
    ("topk", dict(value_dtype="int8")),
    ("topk", dict(method="bogus")),
    ("topk", dict(sample_rate=0)),
    ("topk", dict(sample_rate=1.5)),
    ("topk", dict(route="bogus")),
    ("topk", dict(latency_s=-1)),
    ("topk", dict(bandwidth_Bps=0)),
    ("topk", dict(seed=-1)),
    ("randomk", dict(ratio=0)),
    ("randomk", dict(ratio=2)),
    ("randomk", dict(value_dtype="int8")),
    ("onebit", dict(scaling="bogus")),
    ("onebit", dict(scaling="column_means")),  # the two-phase allreduce needs a sign mode
    ("powersgd", dict(rank=0)),
    ("powersgd", dict(rank=1.5)),
    ("powersgd", dict(rank=10**6)),
    ("powersgd", dict(orthogonalization="bogus")),
    ("powersgd", dict(orthogonalization="gram_schmidt", rank=64)),
    ("powersgd", dict(min_compression_rate=-1)),
    ("powersgd", dict(min_compression_rate=math.inf)),
    ("powersgd", dict(orthogonalization_epsilon=-1)),
    ("topk", dict(rato=0.1)),  # unknown option
    ("allreduce", dict(ratio=0.1)),  # no options at all
]


@pytest.mark.parametrize("name,opts", BAD_OPTIONS, ids=lambda v: str(v))
def test_bad_option_raises_value_error_when_the_hook_is_made(name, opts):
    with pytest.raises(ValueError):
        gt.hook(name, **opts)


@pytest.mark.parametrize("kw", [dict(start_iter=-1)], ids=str)
def test_bad_hook_argument_raises_value_error(kw):
    with pytest.raises(ValueError):
        gt.hook("topk", **kw)


@pytest.mark.parametrize("name,opts", [
    ("topk", dict(ratio=0.01, momentum=0.9, nesterov=True, clip_norm=1.0, warmup_ratios=[0.25],
                  warmup_steps=5, value_dtype="float16", method="exact", route="sparse")),
    ("randomk", dict(ratio=0.5, value_dtype="bfloat16")),
    ("onebit", dict(scaling="sign_l2", error_feedback=False)),
    ("powersgd", dict(rank=4, orthogonalization="householder", min_compression_rate=0.0)),
    ("fp16", {}),
], ids=lambda v: str(v))
def test_good_options_are_accepted(name, opts):
    state, _ = gt.hook(name, **opts)
    assert state.options == opts




# ---- worker-thread errors keep their type and message ------------------------------------------
class _Failing:
    def next(self):
        raise ValueError("bad gradient at index 7")


def test_worker_future_raises_the_original_exception():
    w = Worker(None)
    fut = w.submit(_Failing(), lambda: torch.zeros(1))
    with pytest.raises(ValueError, match="bad gradient at index 7"):
        fut.wait()
    w.close()


def _nan_step(rank, world):
    data = make_data(rank, 3)
    for name, opts in (("topk", dict(ratio=0.1)), ("powersgd", dict(rank=2))):
        torch.manual_seed(0)
        model = DDP(Net())
        state, hook = gt.hook(name, start_iter=0, **opts)
        model.register_comm_hook(state, hook)
        x, y = data[0]
        bad = x.clone()
        bad[0, 0] = math.nan
        with pytest.raises(ValueError, match="non-finite"):
            torch.nn.functional.mse_loss(model(bad), y).backward()
        # DDP finished its step (the error was raised after it): the next step trains
        for x, y in data[1:]:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert params_equal_across_ranks(model)


def test_ddp_backward_raises_the_workers_exception_and_ddp_stays_usable():
    run(_nan_step, 2)
