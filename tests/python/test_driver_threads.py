# SPDX-License-Identifier: Apache-2.0
"""The hooks' worker thread runs our OpenMP kernels with the caller's torch.set_num_threads, not
with the process default a new thread starts from (4 ranks on 2 cores with 2 spinning OpenMP
threads each made PowerSGD's local phase ~100x slower)."""
import pytest

torch = pytest.importorskip("torch")

from gradcomp.torch._driver import Worker  # noqa: E402


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
