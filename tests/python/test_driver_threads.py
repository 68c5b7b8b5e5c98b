# SPDX-License-Identifier: Apache-2.0
"""The hooks' worker thread runs our OpenMP kernels with the caller's torch.set_num_threads, not
with the process default a new thread starts from (4 ranks on 2 cores with 2 spinning OpenMP
threads each made PowerSGD's local phase ~100x slower)."""
import pytest

torch = pytest.importorskip("torch")

from gradcomp.torch._worker import Worker  # noqa: E402


class _NoCollectives:
    def next(self):
        return None


def _threads_seen_by_worker(w: Worker) -> int:
    fut = w.submit(_NoCollectives(), lambda: torch.tensor(torch.get_num_threads()))
    return int(fut.wait())


def test_worker_uses_the_main_threads_num_threads():
    before = torch.get_num_threads()
    want = before + 1  # differs from what a fresh thread would start with
    try:
        torch.set_num_threads(want)
        w = Worker(None)
        assert _threads_seen_by_worker(w) == want
        torch.set_num_threads(1)  # changed after the worker was made: followed at next submit
        assert _threads_seen_by_worker(w) == 1
        w.close()
    finally:
        torch.set_num_threads(before)


def test_wire_bytes_per_collective_kind():
    """Bytes on one rank's link: ring allreduce 2 (P-1)/P of the buffer, all-to-all the (P-1)/P
    sent to others, ring allgather P-1 parts, broadcast once; nothing with one rank."""
    from gradcomp.torch._driver import wire_bytes

    assert wire_bytes("allreduce", 4000, 4) == 6000
    assert wire_bytes("all-to-all", 4000, 4) == 3000
    assert wire_bytes("allgather", 1000, 4) == 3000
    assert wire_bytes("broadcast", 1000, 4) == 1000
    assert wire_bytes("allreduce", 4000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("reduce-scatter", 10, 2)
