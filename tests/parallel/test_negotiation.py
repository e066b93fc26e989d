"""Negotiation whose bytes per rank do not grow with the job: new names are voted through (no rank's table is
gathered), unnamed ops of a loop are agreed by position, and only a mismatch or a stall takes the explaining
round, whose errors are exact and the same on every rank."""
from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import pytest

import hvdlite as hvd
from exact import same

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 240
R, N = hvd.rank(), hvd.size()
TRI = sum(range(N))


def _delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def test_new_names_in_any_order_are_voted_through_without_gathering_any_table(reinit: Callable[..., None]) -> None:
    reinit(cache_capacity=1024)
    names = [f"vote.{i}" for i in range(60)]
    random.Random(R).shuffle(names)
    before = hvd.engine_stats()
    handles = {name: hvd.allreduce_async(np.full(3, R + int(name[5:]), np.float32), op=hvd.Sum, name=name)
               for name in names}
    for name in sorted(names):
        same(hvd.synchronize(handles[name]), np.full(3, N * int(name[5:]) + TRI, np.float32), name)
    delta = _delta(before, hvd.engine_stats())
    assert delta["explain_cycles"] == 0 and delta["full_path_bytes"] == 0, delta
    assert delta["full_cycles"] > 0 and delta["vote_bytes"] > 0, delta


def test_unnamed_ops_of_a_loop_are_agreed_by_position(reinit: Callable[..., None]) -> None:
    """A loop that averages its loss unnamed, each rank computing 0-10 ms of its own before each op: after the
    first, each step's op is agreed on the bit-vector alone, in exactly one round (an engine with nothing of its
    own pending starts none before this rank's op: a round then agrees nothing and the op waits for the next).
    A 30 s heartbeat: a rank descheduled past the default 1 s on a loaded machine would take a heartbeat round."""
    reinit(idle_heartbeat_seconds=30.0)
    for step in range(3):
        same(hvd.allreduce(np.array([R + step], np.float64), op=hvd.Sum), np.array([N * step + TRI], np.float64))
    before = hvd.engine_stats()
    for step in range(40):
        time.sleep(0.001 * ((7 * step + 3 * R) % 11))
        same(hvd.allreduce(np.array([R + step], np.float64), op=hvd.Sum), np.array([N * step + TRI], np.float64))
    delta = _delta(before, hvd.engine_stats())
    assert delta["full_cycles"] == 0 and delta["vote_bytes"] == 0, delta
    assert delta["cycles"] == 40, delta


def test_a_burst_of_cached_names_paused_midway_takes_one_round_a_step_on_a_crowded_node(
        reinit: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a crowded node (more ranks than cores) a burst's first submission may wake the engine while the
    submitting thread is descheduled midway (it loses the GIL after the switch interval); here each rank pauses
    5 ms after half its 16 names, as such a thread does (running no CPU): the engine waits for the rest of the
    burst, so each step is one round (it was two: the first round agreed the half each rank had submitted)."""
    reinit(idle_heartbeat_seconds=30.0)
    from hvdlite.core.engine import polling
    monkeypatch.setattr(polling, "CROWDED", True)
    names = [f"burst.{i}" for i in range(16)]

    def step(k: int) -> None:
        handles = []
        for i, name in enumerate(names):
            if i == 8:
                time.sleep(0.005)
            handles.append(hvd.allreduce_async(np.full(2, R + k + i, np.float32), op=hvd.Sum, name=name))
        for i, handle in enumerate(handles):
            same(hvd.synchronize(handle), np.full(2, TRI + N * (k + i), np.float32), names[i])

    step(0)
    hvd.barrier()
    before = hvd.engine_stats()
    for k in range(1, 11):
        step(k)
    delta = _delta(before, hvd.engine_stats())
    assert delta["full_cycles"] == 0 and delta["cycles"] == 10, delta


def test_an_op_polled_without_blocking_is_not_held_back_on_a_crowded_node(
        reinit: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a crowded node the engine's wait for the rest of a burst ends when none comes (polling.BURST_QUIET_S):
    ops whose thread polls the handle, never blocking on it, run at once (each waited out the idle bound before,
    here a quarter of the 60 s stall-check period)."""
    reinit(idle_heartbeat_seconds=30.0)
    from hvdlite.core.engine import polling
    monkeypatch.setattr(polling, "CROWDED", True)
    start = time.monotonic()
    for k in range(3):
        handle = hvd.allreduce_async(np.full(2, R + k, np.float32), op=hvd.Sum, name="polled")
        while not hvd.poll(handle):
            time.sleep(0.002)
        same(hvd.synchronize(handle), np.full(2, TRI + N * k, np.float32), f"op {k}")
    assert time.monotonic() - start < 3.0, f"3 polled ops took {time.monotonic() - start:.1f} s"


def test_the_others_steps_while_rank_0_has_joined_gather_no_table(reinit: Callable[..., None]) -> None:
    """Rank 0 joins; the others' steps of cached, new and unnamed ops while it has joined are cached and voted
    rounds (rank 1 proposes) with rank 0 standing in with zeros: only its join's own round gathered the tables."""
    reinit()
    names = [f"joined.{i}" for i in range(4)]
    for name in names:
        same(hvd.allreduce(np.full(2, R, np.float32), op=hvd.Sum, name=name), np.full(2, TRI, np.float32), name)
    same(hvd.allreduce(np.array([R], np.int64), op=hvd.Sum), np.array([TRI], np.int64), "unnamed")
    if R == 0:
        assert hvd.join() in range(1, N)
        return
    same(hvd.allreduce(np.full(2, R, np.float32), op=hvd.Sum, name=names[0]), np.full(2, TRI, np.float32))
    before = hvd.engine_stats()
    for k in range(5):
        handles = [hvd.allreduce_async(np.full(2, R + k, np.float32), op=hvd.Sum, name=name)
                   for name in [*names, f"joined.new.{k}"]]
        for handle in handles:
            same(hvd.synchronize(handle), np.full(2, TRI + (N - 1) * k, np.float32), f"step {k}")
        same(hvd.allreduce(np.array([R + k], np.int64), op=hvd.Sum), np.array([TRI + (N - 1) * k], np.int64))
    delta = _delta(before, hvd.engine_stats())
    assert delta["explain_cycles"] == 0 and delta["full_path_bytes"] == 0 and delta["vote_bytes"] > 0, delta
    assert hvd.join() in range(1, N)


def test_unnamed_ops_of_two_shapes_alternating_stay_exact(reinit: Callable[..., None]) -> None:
    """One stream, two signatures in turn: each op misses the stream's bit and is voted through, exactly."""
    reinit()
    for step in range(10):
        shape = (2,) if step % 2 else (3, 1)
        same(hvd.allreduce(np.full(shape, R + step, np.int64), op=hvd.Sum), np.full(shape, N * step + TRI, np.int64))


def test_a_mismatch_found_by_the_vote_is_explained_on_every_rank(reinit: Callable[..., None]) -> None:
    reinit()
    hvd.allreduce(np.ones(2, np.float32), name="agreed.first")
    shape = (3,) if R == N - 1 else (2,)
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(np.ones(shape, np.float32), name="voted.mismatch")
    others = "rank 0" if N == 2 else "ranks " + ", ".join(map(str, range(N - 1)))
    text = str(info.value).split(": ", 1)[1]  # the rest is identical everywhere
    assert text.startswith(f"Mismatched allreduce for tensor 'voted.mismatch': the shape differs across ranks "
                           f"({others}: (2,); rank {N - 1}: (3,)). Every rank must submit"), text
    assert len(set(hvd.allgather_object(text))) == 1
    # a cached name whose signature changes on one rank only: the vote finds it too
    with pytest.raises(hvd.TensorMismatchError, match=r"the dtype differs across ranks"):
        hvd.allreduce(np.ones(2, np.float64 if R == 0 else np.float32), name="agreed.first")
    same(hvd.allreduce(np.full(2, R, np.float32), op=hvd.Sum, name="agreed.first"), np.full(2, TRI, np.float32))


@pytest.mark.mpi(min_size=3)
def test_a_set_without_rank_0_is_proposed_by_its_lowest_member(reinit: Callable[..., None]) -> None:
    reinit()
    members = list(range(1, N))
    ps = hvd.add_process_set(members)
    try:
        if R in members:
            names = [f"set.{i}" for i in range(20)]
            random.Random(R).shuffle(names)
            handles = {name: hvd.allreduce_async(np.full(2, R, np.float32), op=hvd.Sum, name=name, process_set=ps)
                       for name in names}
            for name, handle in handles.items():
                same(hvd.synchronize(handle), np.full(2, sum(members), np.float32), name)
            for step in range(5):  # unnamed, by position in the set's own stream
                same(hvd.allreduce(np.array([R + step], np.int64), op=hvd.Sum, process_set=ps),
                     np.array([sum(members) + step * len(members)], np.int64))
        same(hvd.allreduce(np.array([R], np.int64), op=hvd.Sum, name="after.set"), np.array([TRI], np.int64))
    finally:
        hvd.remove_process_set(ps)


@pytest.mark.mpi(min_size=3)
def test_a_set_op_does_not_wait_for_a_non_member_sleeping_in_user_code(reinit: Callable[..., None]) -> None:
    """A set of ranks 0 and 1 runs 40 small allreduces while the other ranks sleep in user code: the set's ops
    are negotiated among its members by their own engine (no round of the whole job's engine: before, each
    op was one, waiting for a non-member's idle pause, 70-107 ms), so they take milliseconds each."""
    reinit()
    ps = hvd.add_process_set([0, 1])
    took, job_rounds = 0.0, 0
    try:
        hvd.barrier()
        before = hvd.engine_stats()["busy_cycles"]
        if R < 2:
            start = time.monotonic()
            for i in range(40):
                same(hvd.allreduce(np.full(4, R + i, np.float32), op=hvd.Sum, name="set.op", process_set=ps),
                     np.full(4, 1 + 2 * i, np.float32), f"op {i}")
            took = time.monotonic() - start
            job_rounds = hvd.engine_stats()["busy_cycles"] - before
        else:
            time.sleep(2.5)
        hvd.barrier()
    finally:
        hvd.remove_process_set(ps)
    assert job_rounds == 0, f"the whole job's engine ran {job_rounds} rounds with work for the set's ops"
    assert took < 2.0, f"40 set ops took {took:.2f} s"
