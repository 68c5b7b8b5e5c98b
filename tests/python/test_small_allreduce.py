# SPDX-License-Identifier: Apache-2.0
"""The driver's small fp32 allreduce on gloo: one allgather of every rank's buffer (isend/irecv
pairs) and a rank-ordered sum, up to _driver.P2P_ALLREDUCE_BYTES, gloo's ring above. Checked bit
for bit against an independent rank-ordered sum on 2, 3 and 4 ranks (sizes 1, 2, 31, 4097 and the
threshold itself), every rank holding the same bits, the ring taking over one value above the
threshold (the same bits on every rank, the sum to rounding), the wire bytes counted by the route
taken, and PowerSGD's allreduces through it, equal to PowerSGD through gloo's ring to rounding."""
import os
import types

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from gradcomp import _C  # noqa: E402
from gradcomp.torch import _driver, run_sync  # noqa: E402

from ddp_util import run, tmpdir  # noqa: E402

LIMIT = _driver.P2P_ALLREDUCE_BYTES // 4  # values at the threshold
SIZES = (1, 2, 31, 4097, LIMIT, LIMIT + 1)


def _values(rank, n):
    """Magnitudes over 12 decades, so that the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(7 * rank + n)
    return torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-6, 6, (n,), generator=g))


def _collective(buf, world):
    """An in-place fp32 allreduce as a plan hands it to the driver."""
    return types.SimpleNamespace(kind="allreduce", type="float32", in_place=True, world=world,
                                 send_bytes=buf.numel() * 4, send=lambda: buf, recv=lambda: buf)


def _worker(rank, world, out_dir):
    got = {}
    for n in SIZES:
        buf = _values(rank, n)
        counted = _driver.PlanStats()
        work = _driver.launch(_collective(buf, world), dist.group.WORLD, counted)
        got[f"wire/{n}"] = counted.wire_bytes
        got[f"pairs/{n}"] = isinstance(work, _driver._Summed)
        work.wait()
        want, mag = _values(0, n), _values(0, n).abs()
        for r in range(1, world):
            want.add_(_values(r, n))  # one elementwise add at a time, in rank order
            mag.add_(_values(r, n).abs())
        got[f"ordered/{n}"] = bool(torch.equal(buf, want))
        # any order of the sum: within a few roundings of the magnitudes summed
        got[f"close/{n}"] = bool(((buf - want).abs() <= 4 * 2.0 ** -23 * mag).all())
        every = [torch.zeros_like(buf) for _ in range(world)]
        dist.all_gather(every, buf)
        got[f"same/{n}"] = all(torch.equal(every[0], e) for e in every)
    # PowerSGD's two allreduces per bucket through the pairs against gloo's ring
    shapes = [[64, 48], [48], [33, 17]]
    n = sum(int(torch.tensor(s).prod()) for s in shapes)
    out = {}
    summed = []  # the allreduces that went as an allgather and a rank-ordered sum
    by_gather = _driver._all_reduce_p2p
    _driver._all_reduce_p2p = lambda *a: summed.append(a) or by_gather(*a)
    for limit in (_driver.P2P_ALLREDUCE_BYTES, 0):
        _driver.P2P_ALLREDUCE_BYTES = limit
        del summed[:]
        plan = _C.make_plan("powersgd", n, "float32", world, options={"rank": 2},
                            shapes=shapes)
        g = _values(rank, n) * 1e-3
        for _ in range(3):  # the state (Q, the error) carried over steps
            x = g.clone()
            plan.begin(x)
            stats = run_sync(plan, dist.group.WORLD)
        out[limit] = x
        got[f"psgd_collectives/{limit}"] = stats.collectives
        got[f"psgd_summed/{limit}"] = len(summed)
        got[f"psgd_wire/{limit}"] = stats.wire_bytes
    _driver.P2P_ALLREDUCE_BYTES = LIMIT * 4
    _driver._all_reduce_p2p = by_gather
    a, b = out.values()
    # (the two sums differ in their last bits, which PowerSGD's orthogonalization carries on)
    got["psgd_close"] = bool((a - b).abs().max() <= 1e-5 * a.abs().max())
    torch.save(got, os.path.join(out_dir, f"got_{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_allreduce_is_the_rank_ordered_sum_on_every_rank(world):
    d = tmpdir()
    run(_worker, world, d)
    for rank in range(world):
        got = torch.load(os.path.join(d, f"got_{rank}.pt"))
        for n in SIZES:
            assert got[f"same/{n}"], (rank, n)
            assert got[f"close/{n}"], (rank, n)
            small = n <= LIMIT
            assert got[f"pairs/{n}"] == small, (rank, n)
            if small:
                assert got[f"ordered/{n}"], (rank, n)
            # wire bytes by the route taken: (P - 1) buffers by the allgather, the ring's
            # 2 (P - 1) / P of one above the threshold
            b = 4 * n
            assert got[f"wire/{n}"] == ((world - 1) * b if small else 2 * (world - 1) * b // world)
        # (the ring's order shows in the bits of a sum of values over 12 decades)
        if world > 2:
            assert not got[f"ordered/{LIMIT + 1}"], "the ring summed in rank order"
        assert got["psgd_close"], rank
        on = _driver.P2P_ALLREDUCE_BYTES
        # PowerSGD's two allreduces a step (P, then Q), over 3 steps all summed by the
        # allgather below the threshold, none with the threshold at 0; and counted by route
        assert got[f"psgd_collectives/{on}"] == got["psgd_collectives/0"] == 2, rank
        assert got[f"psgd_summed/{on}"] == 6 and got["psgd_summed/0"] == 0, rank
        ring, pairs = got["psgd_wire/0"], got[f"psgd_wire/{on}"]
        assert abs(2 * pairs - world * ring) <= 2 * world, (rank, pairs, ring)
