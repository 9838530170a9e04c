"""The GPU tests' turns (``conftest.py``): a large test starts only once no other GPU test runs;
a small one never waits."""
from __future__ import annotations

import fcntl
import threading

from conftest import GPU_TURNS, LARGE_REFERENCE, alone_if_large


def test_a_large_test_waits_until_no_other_gpu_test_runs():
    entered = threading.Event()

    def large() -> None:
        with alone_if_large(LARGE_REFERENCE):
            entered.set()

    with open(GPU_TURNS, "a+b") as other:  # another worker's GPU test in progress
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        thread = threading.Thread(target=large)
        thread.start()
        assert not entered.wait(0.5)
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
    assert entered.wait(10)
    thread.join()


def test_a_small_test_runs_beside_others():
    with open(GPU_TURNS, "a+b") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        with alone_if_large(LARGE_REFERENCE - 1):
            pass
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
