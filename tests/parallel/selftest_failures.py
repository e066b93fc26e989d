"""Not collected by the spawner (no test_ prefix): tests/test_parallel.py runs it to check that the in-rank
harness names a failure with its rank and keeps the ranks in step after it."""
from __future__ import annotations

import numpy as np

import hvdlite as hvd


def test_fails_on_rank_one_after_a_pending_op(rank: int) -> None:
    if rank != 1:
        hvd.allreduce_async(np.ones(1), name="left.behind")  # rank 1 never submits it
    assert rank != 1, "deliberate failure on rank 1"


def test_ranks_are_in_step_afterwards(size: int) -> None:
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum), np.full(3, float(size)))
