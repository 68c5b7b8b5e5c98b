# SPDX-License-Identifier: Apache-2.0
"""hook(..., overlap=False): every bucket is held until DDP hands over the step's last one, so
the exchange runs after backward (the structure of an optimizer-side compressed allreduce). It
must give bitwise the result of the overlapped hook, start no bucket before the last was handed
over, and, when the last bucket fails, still complete the held ones (DDP waits for them)."""
import faulthandler
import pickle

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (EmbedNet, Net, make_data, mark_ok, params_equal_across_ranks,  # noqa: E402
                      run_ok)

STEPS = 6


def _train(name, opts, overlap, data):
    torch.manual_seed(0)
    # several buckets once DDP rebuilt them after the first step: fc3 and fc2 in the first
    # (up to 1 MiB), fc1's bias and weight in one each
    model = DDP(Net(d_hidden=600), bucket_cap_mb=0.001)
    state, hook = gt.hook(name, model=model, overlap=overlap, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, state


def _same_result_and_order(rank, world, out_dir):
    faulthandler.dump_traceback_later(120, exit=True)  # a held bucket never sent would hang
    data = make_data(rank, STEPS)
    for name, opts in (("onebit", {}), ("topk", dict(ratio=0.1)), ("powersgd", dict(rank=2))):
        ref, ref_state = _train(name, opts, True, data)
        held, state = _train(name, opts, False, data)
        assert state.iter == ref_state.iter == STEPS
        for a, b in zip(ref.parameters(), held.parameters()):
            assert torch.equal(a, b), name
        assert params_equal_across_ranks(held)
        iters = sorted({r["iter"] for r in state.timeline} - {0})
        assert len(iters) == STEPS - 1, (name, iters)
        for it in iters:
            rows = gt.timeline(state, it)
            assert len(rows) >= 3, (name, it, len(rows))
            last_queued = max(r["queued_ms"] for r in rows)
            first_started = min(r["started_ms"] for r in rows)
            assert first_started >= last_queued, (name, it, rows)
        # the option survives pickling (a restored job keeps its structure)
        assert pickle.loads(pickle.dumps(state)).overlap is False
    faulthandler.cancel_dump_traceback_later()
    mark_ok(out_dir, rank)


def test_held_buckets_give_the_overlapped_result_after_the_last_bucket():
    run_ok(_same_result_and_order, 2)


def _last_bucket_fails(rank, world, out_dir):
    faulthandler.dump_traceback_later(120, exit=True)
    torch.manual_seed(0)
    model = DDP(EmbedNet(sparse=True))  # the embedding's bucket is the step's last
    state, hook = gt.hook("topk", ratio=0.1, start_iter=0, overlap=False)
    model.register_comm_hook(state, hook)
    idx = torch.randint(0, 50, (16,))
    for _ in range(2):  # the error each time (not a hang on the held fc bucket), DDP usable
        with pytest.raises(ValueError, match="sparse=False"):
            model(idx).sum().backward()
    faulthandler.cancel_dump_traceback_later()
    mark_ok(out_dir, rank)


def test_a_failed_last_bucket_releases_the_held_ones():
    run_ok(_last_bucket_fails, 2)


def test_overlap_must_be_a_bool_and_is_not_an_auto_option():
    with pytest.raises(ValueError, match="overlap must be True or False"):
        gt.hook("onebit", overlap="no")
    with pytest.raises(ValueError, match="overlap"):
        gt.hook("auto", overlap=False)
