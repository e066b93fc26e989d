"""Engine hardening (issue 10): inputs real jobs produce must neither hang, corrupt nor kill the engine,
and every decision that shapes MPI traffic is the same on every rank."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 420


@pytest.mark.parametrize("fusion", [4 << 20, 0], ids=["fusion", "no-fusion"])
def test_empty_groups_return_empty_lists_at_once(fusion: int, reinit, size: int) -> None:
    reinit(fusion_threshold_bytes=fusion)
    assert hvd.grouped_allreduce([]) == []
    assert hvd.grouped_allgather([]) == []
    assert hvd.grouped_reducescatter([]) == []
    assert hvd.synchronize(hvd.grouped_allreduce_async([], name="empty.named")) == []
    # the engine goes on, and so do the generated names (every rank made the same calls)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), np.full(2, float(size)))


def test_settings_that_shape_traffic_are_rank_zeros(reinit, rank: int, size: int, capsys) -> None:
    # Every rank but 0 asks for no fusion, tiny chunks and no cache: rank 0's values must win everywhere.
    settings = {} if rank == 0 else {"fusion_threshold_bytes": 0, "allreduce_chunk_bytes": 8, "cache_capacity": 0}
    capsys.readouterr()
    reinit(**settings)
    warned = [line.split("WARNING: ", 1)[1] for line in capsys.readouterr().err.splitlines()
              if "on rank 0; using rank 0's value" in line]
    if rank == 0:
        assert warned == []
    else:
        assert sorted(w.split()[1] for w in warned) == ["allreduce_chunk_bytes", "cache_capacity",
                                                        "fusion_threshold_bytes"], warned
    from hvdlite.core.frontend import setting
    assert (setting("fusion_threshold_bytes"), setting("allreduce_chunk_bytes"), setting("cache_capacity")) == \
        (4 << 20, 1 << 20, 1024)
    handles = [hvd.allreduce_async(np.full(5, float(i + rank)), op=hvd.Sum, name=f"agreed.{i}") for i in range(8)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(hvd.synchronize(h), np.full(5, float(size * i + size * (size - 1) // 2)))


def test_remove_process_set_waits_for_its_op_in_flight(rank: int, size: int) -> None:
    members = list(range(size - 1))  # every rank but the last (at -n 2, a set of one)
    ps = hvd.add_process_set(members)
    handle = hvd.allreduce_async(np.full(3, 2.0), op=hvd.Sum, name="in.flight", process_set=ps) \
        if rank in members else None
    assert hvd.remove_process_set(ps)
    if handle is not None:
        np.testing.assert_array_equal(hvd.synchronize(handle), np.full(3, 2.0 * len(members)))
    np.testing.assert_array_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.remove"), [float(size)])


@pytest.mark.mpi(sizes=(4,))
def test_one_name_in_two_disjoint_process_sets_at_once(rank: int) -> None:
    low, high = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])
    try:
        mine = low if rank < 2 else high
        for step in range(3):  # one DistributedOptimizer per pipeline stage: the same names in each
            h = hvd.allreduce_async(np.full(2, float(rank + step)), op=hvd.Sum, name="stage.grad", process_set=mine)
            first = 0 if rank < 2 else 2
            np.testing.assert_array_equal(hvd.synchronize(h), np.full(2, float(2 * first + 1 + 2 * step)))
    finally:
        hvd.remove_process_set(high)
        hvd.remove_process_set(low)


def test_bad_argument_fails_at_submit_and_engine_goes_on(size: int) -> None:
    with pytest.raises(TypeError, match="prescale_factor/postscale_factor are not defined for bool"):
        hvd.allreduce(np.ones(3, bool), op=hvd.Sum, prescale_factor=2.0, name="bool.scaled")
    with pytest.raises(TypeError, match="not defined for bool"):
        hvd.reducescatter(np.ones(4, bool), op=hvd.Sum, postscale_factor=0.5, name="bool.rs")
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3, bool), op=hvd.Sum, name="bool.ok"), np.ones(3, bool))
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), np.full(2, float(size)))


def test_gradient_overlap_auto_is_one_verdict_for_the_job(reinit, rank: int) -> None:
    from hvdlite.core import frontend
    from hvdlite.core.frontend import local_overlap_verdict
    reinit(gradient_overlap="auto")
    # rank 0 runs on an accelerator (its own view: overlap), the others claim every core (theirs: no overlap)
    threads = None if rank == 0 else 10**6
    assert local_overlap_verdict(threads) is (rank == 0)
    assert frontend.gradient_overlap(threads) is False  # the same verdict everywhere: the minimum
    assert frontend.gradient_overlap(None) is True


@pytest.mark.mpi(min_size=3)
def test_process_set_ops_do_not_wait_for_idle_non_members(reinit, rank: int, size: int) -> None:
    import time
    # With a 30 s heartbeat, ops that waited for the idle non-member's heartbeat would take minutes.
    reinit(idle_heartbeat_seconds=30.0)
    pair = hvd.add_process_set([0, 1])
    try:
        if rank in (0, 1):
            start = time.monotonic()
            for i in range(10):
                np.testing.assert_array_equal(hvd.allreduce(np.full(2, float(i)), op=hvd.Sum, name="pair.op",
                                                            process_set=pair), np.full(2, 2.0 * i))
            elapsed = time.monotonic() - start
            assert elapsed < 20, f"10 ops of a 2-rank set took {elapsed:.1f} s while rank {size - 1} idled"
        else:
            time.sleep(0.5)  # idle, with nothing of its own to submit
    finally:
        hvd.remove_process_set(pair)


@pytest.mark.parametrize("attempt", range(3))
def test_stall_verdict_reaches_every_rank_in_the_same_round(reinit, rank: int, size: int, attempt: int) -> None:
    # Every rank submits a name no other rank submits; their ages differ by the submission skew. Each rank
    # must get a StallError for its own name (never a ShutdownError), in the same round.
    reinit(stall_check_time_seconds=0.3, stall_shutdown_time_seconds=1.0, idle_heartbeat_seconds=0.05)
    import time
    time.sleep(0.05 * rank)  # skew the submissions, so the names cross the limit at different times
    with pytest.raises(hvd.StallError) as info:
        hvd.allreduce(np.ones(2), name=f"only.rank{rank}")
    others = [r for r in range(size) if r != rank]
    assert f"allreduce of 'only.rank{rank}' stalled" in str(info.value)
    assert f"ranks {others} never submitted it; ranks [{rank}] did." in str(info.value)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.stall"), [float(size)])


@pytest.mark.parametrize("fusion", [4 << 20, 0], ids=["fusion", "no-fusion"])
def test_vectors_shorter_than_the_ranks_reduce_exactly(fusion: int, reinit, rank: int, size: int) -> None:
    """Vectors shorter than the ranks (a scalar metric; under Open MPI from 4 ranks a reduce and a broadcast,
    engine/chunks.start_allreduce): every op's result is exact, out of place and in place, alone and fused, and
    the inputs keep their values."""
    reinit(fusion_threshold_bytes=fusion)
    values = [float(r + 1) for r in range(size)]
    scalar = np.array([rank + 1.0])
    trio = np.array([rank + 1, -(rank + 1), 2], dtype=np.int32)
    product = float(np.prod(values))
    cases = {hvd.Sum: (sum(values), np.array([sum(values), -sum(values), 2 * size])),
             hvd.Min: (1.0, np.array([1, -size, 2])), hvd.Max: (float(size), np.array([size, -1, 2])),
             hvd.Product: (product, np.array([product, (-1) ** size * product, 2 ** size]))}
    for op, (want_scalar, want_trio) in cases.items():
        got_scalar, got_trio = hvd.grouped_allreduce([scalar, trio], op=op)
        assert got_scalar.shape == (1,) and got_scalar[0] == want_scalar, (op, got_scalar)
        np.testing.assert_array_equal(got_trio, want_trio.astype(np.int32))
        np.testing.assert_array_equal(hvd.allreduce(trio, op=op), want_trio.astype(np.int32))
    assert scalar[0] == rank + 1.0 and list(trio) == [rank + 1, -(rank + 1), 2]
    assert hvd.allreduce(np.float64(rank + 1.0), op=hvd.Average) == sum(values) / size  # a 0-d array
    inplace = np.array([rank + 1.0, 0.5])
    hvd.allreduce_(inplace, name="short.inplace", op=hvd.Sum)
    np.testing.assert_array_equal(inplace, [sum(values), 0.5 * size])
