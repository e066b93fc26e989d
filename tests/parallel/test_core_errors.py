"""Mismatched arguments raise the same TensorMismatchError on every rank, naming the tensor and the ranks;
the engine goes on working after each one."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

import hvdlite as hvd

MPI_SIZES = (2, 3)

CASES = {
    "shape": lambda odd: hvd.allreduce(np.ones(4 if odd else 3), name="t.shape"),
    "dtype": lambda odd: hvd.allreduce(np.ones(3, np.float64 if odd else np.float32), name="t.dtype"),
    "reduce op": lambda odd: hvd.allreduce(np.ones(3), op=hvd.Max if odd else hvd.Sum, name="t.op"),
    "prescale_factor": lambda odd: hvd.allreduce(np.ones(3), prescale_factor=2.0 if odd else 1.0, name="t.pre"),
    "postscale_factor": lambda odd: hvd.allreduce(np.ones(3), postscale_factor=3.0 if odd else 1.0,
                                                  name="t.post"),
    "root rank": lambda odd: hvd.broadcast(np.ones(3), root_rank=1 if odd else 0, name="t.root"),
    "shape beyond the first dimension": lambda odd: hvd.allgather(np.ones((1, 3 if odd else 2)), name="t.ag"),
    "operation": lambda odd: (hvd.allgather if odd else hvd.allreduce)(np.ones(3), name="t.kind"),
}


@pytest.mark.parametrize("field", list(CASES))
def test_mismatch_raises_on_every_rank_then_engine_goes_on(field: str, rank: int, size: int) -> None:
    last = size - 1
    with pytest.raises(hvd.TensorMismatchError, match=f"the {field} differs across ranks") as info:
        CASES[field](rank == last)
    assert f"rank {last}" in str(info.value)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"after.{field}"),
                                  np.full(2, float(size)))


def test_mismatch_message_is_exact_and_identical_everywhere(rank: int, size: int) -> None:
    last = size - 1
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(np.ones(4 if rank == last else 3), name="t.exact")
    line = sys._getframe().f_lineno - 1
    text = str(info.value).split(": ", 1)[1]  # drop the "rank r:" prefix; the rest is identical everywhere
    agreeing = f"ranks {', '.join(map(str, range(last)))}: (3,)" if last > 1 else "rank 0: (3,)"
    assert text == (f"Mismatched allreduce for tensor 't.exact': the shape differs across ranks ({agreeing}; "
                    f"rank {last}: (4,)). Every rank must submit a name with the same shape; give different "
                    f"tensors different names. Submitted at: ranks {', '.join(map(str, range(size)))}: "
                    f"{os.path.relpath(__file__)}:{line}.")
    assert len(set(hvd.allgather_object(text))) == 1


def test_name_in_flight_is_rejected_at_submit(rank: int, size: int) -> None:
    # The last rank submits first and alone, so "dup" cannot complete before its second submission; the
    # others submit it only after the barrier.
    if rank == size - 1:
        handle = hvd.allreduce_async(np.ones(1), name="dup")
        with pytest.raises(hvd.HvdliteError, match="already in flight"):
            hvd.allreduce_async(np.ones(1), name="dup")
    hvd.barrier()
    if rank != size - 1:
        handle = hvd.allreduce_async(np.ones(1), name="dup")
    assert hvd.synchronize(handle).tolist() == [1.0]


def test_global_set_cannot_be_added_again(size: int) -> None:
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set(list(range(size)))


@pytest.mark.mpi(min_size=3)
def test_process_set_mismatch_is_a_stall_naming_both_sets(reinit, rank: int, size: int) -> None:
    # Ranks 0 and the last agree to use the set {0, last}, but the last passes the global set. Names are per
    # process set (ranks may legally submit one name in two sets in different orders), so this is a stall,
    # and the stall error says where the missing rank used the name.
    reinit(stall_check_time_seconds=0.5, stall_shutdown_time_seconds=1.0)
    last = size - 1
    ps = hvd.add_process_set([0, last])
    start = time.monotonic()
    try:
        if rank in (0, last):
            with pytest.raises(hvd.StallError) as info:
                hvd.allreduce(np.ones(2), name="t.ps", process_set=hvd.global_process_set if rank == last else ps)
            text = str(info.value)
            if rank == 0:
                assert f"ranks [{last}] never submitted it; ranks [0] did. Rank(s) [{last}] submitted it for " \
                       f"process set 0 instead: the ranks disagree on its process set." in text, text
            else:
                assert f"Rank(s) [0] submitted it for process set {ps.process_set_id} instead" in text, text
    finally:
        # the set's own engine (on 0 and the last) and the whole job's (the last's op) each give their verdict
        # (once one stalled name is past the limit, every name stalled then in that engine fails with it): the
        # removal comes after both, on every rank
        time.sleep(max(0.0, 3.0 - (time.monotonic() - start)))
        hvd.remove_process_set(ps)


@pytest.mark.mpi(min_size=2)
def test_one_name_in_a_set_and_the_global_set_in_different_orders(rank: int, size: int) -> None:
    # Found by the fuzzer (seed 7): legal, since every process set has its own names.
    solo = hvd.add_process_set([0])
    try:
        if rank == 0:
            np.testing.assert_array_equal(hvd.allreduce(np.full(2, 5.0), op=hvd.Sum, name="X", process_set=solo),
                                          np.full(2, 5.0))
        out = hvd.broadcast(np.full(2, float(rank)), root_rank=0, name="X")
        np.testing.assert_array_equal(out, np.zeros(2))
    finally:
        hvd.remove_process_set(solo)
