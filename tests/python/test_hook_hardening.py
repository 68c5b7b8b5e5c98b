# SPDX-License-Identifier: Apache-2.0
"""The DDP hooks under failure (issue 11): bad options are refused when the hook is made."""
import math

import pytest

torch = pytest.importorskip("torch")
import gradcomp.torch as gt  # noqa: E402

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


