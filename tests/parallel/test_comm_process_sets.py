"""Process sets built from communicators as Horovod documents them: each rank passes its own piece of a
``Split`` to ``hvd.ProcessSet(comm)``; init() (and add_process_set()) registers one set per distinct piece,
numbered as Horovod numbers them, and refuses duplicates (an equal communicator, a Dup, a rank list equal to
a piece) with ValueError on the ranks whose entry it is, after which init() takes a valid list."""
from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import hvdlite as hvd
from exact import same
from hvdlite.core.basics import _basics

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 240
world = MPI.COMM_WORLD
R, N = world.Get_rank(), world.Get_size()
EVENS, ODDS = list(range(0, N, 2)), list(range(1, N, 2))
MINE = EVENS if R % 2 == 0 else ODDS


def _pieces() -> tuple[Any, Any]:
    sub = world.Split(color=R % 2, key=R)
    return sub, sub.Dup()


def _pairs_up(tag: str) -> None:
    """The ranks' next unnamed collectives still agree."""
    for _ in range(3):
        same(hvd.allreduce(np.full(2, float(R)), op=hvd.Sum), np.full(2, float(sum(range(N)))), tag)


def test_init_registers_one_set_per_piece_in_horovods_numbering(reinit: Callable[..., None]) -> None:
    sub, _ = _pieces()
    ps = hvd.ProcessSet(sub)
    reinit(comm=world, process_sets=[ps])
    assert _basics._get_process_set_ids_and_ranks() == {0: list(range(N)), 1: EVENS, 2: ODDS}
    assert (ps.process_set_id, ps.ranks, ps.size(), ps.rank()) == (1 + R % 2, MINE, len(MINE), MINE.index(R))
    assert _basics._comm_process_set_id(sub) == ps.process_set_id
    same(hvd.allreduce(np.full(3, float(R)), op=hvd.Sum, process_set=ps), np.full(3, float(sum(MINE))), "piece")
    _pairs_up("after init")


def test_duplicates_are_refused_on_the_ranks_concerned_then_init_takes_a_valid_list(
        reinit: Callable[..., None]) -> None:
    sub, sub_dup = _pieces()
    world_dup = world.Dup()
    reinit(comm=world)
    evens_by_ranks = hvd.ProcessSet(EVENS)  # equal to the even ranks' piece
    # a Dup of the world (the global set) and a Dup of the piece: refused on every rank
    with pytest.raises(ValueError, match="duplicate: a process set with ranks"):
        hvd.init(comm=world, process_sets=[hvd.ProcessSet(sub), hvd.ProcessSet(world_dup),
                                           hvd.ProcessSet(sub_dup), evens_by_ranks, hvd.ProcessSet([0])])
    duplicate = f"entry 1 is a duplicate: a process set with ranks {MINE} is already"
    with pytest.raises(ValueError, match=re.escape(duplicate)):
        hvd.init(comm=world, process_sets=[hvd.ProcessSet(sub), hvd.ProcessSet(sub_dup)])
    # the rank list equals the even ranks' piece: refused there only (at -n 2, [0] is the even piece too,
    # and the odd rank's [0] duplicates the rank list before it)
    sets = [hvd.ProcessSet(sub), hvd.ProcessSet(EVENS), hvd.ProcessSet([0])]
    if R % 2 == 0 or N == 2:
        with pytest.raises(ValueError, match=f"process sets refused on rank {R}: entry"):
            hvd.init(comm=world, process_sets=sets)
    else:
        hvd.init(comm=world, process_sets=sets)
        assert [s.process_set_id for s in sets] == [2, 1, 3]
    _pairs_up("after the refusals")
    valid = [hvd.ProcessSet(sub)] + ([hvd.ProcessSet([0])] if N > 2 else [])
    hvd.init(comm=world, process_sets=valid)  # every rank, those that registered the last list too
    table = {0: list(range(N)), 1: EVENS, 2: ODDS, **({3: [0]} if N > 2 else {})}
    assert _basics._get_process_set_ids_and_ranks() == table
    assert valid[0].process_set_id == 1 + R % 2
    same(hvd.allreduce(np.full(2, 1.0), op=hvd.Sum, process_set=valid[0]), np.full(2, float(len(MINE))), "set")
    _pairs_up("after the valid list")
    for c in (sub, sub_dup, world_dup):
        c.Free()


def test_add_process_set_takes_a_communicator_piece(reinit: Callable[..., None]) -> None:
    sub, sub_dup = _pieces()
    reinit(comm=world)
    evens = hvd.add_process_set(EVENS)
    if R % 2 == 0:  # the even piece is registered already: refused there; the odd piece is new
        with pytest.raises(ValueError, match=re.escape(f"ranks {EVENS} is already registered")):
            hvd.add_process_set(hvd.ProcessSet(sub))
        ps = evens
    else:
        ps = hvd.add_process_set(hvd.ProcessSet(sub))
        assert (ps.process_set_id, ps.ranks) == (2, ODDS)
    assert _basics._get_process_set_ids_and_ranks() == {0: list(range(N)), 1: EVENS, 2: ODDS}
    with pytest.raises(ValueError, match="is already registered"):
        hvd.add_process_set(hvd.ProcessSet(sub_dup))  # both pieces exist: refused on every rank
    with pytest.raises(ValueError, match=re.escape(f"ranks {list(range(N))} is already registered")):
        hvd.add_process_set(hvd.ProcessSet(world))
    same(hvd.allgather(np.full(1, float(R)), process_set=ps), np.array(MINE, dtype=float), "piece allgather")
    _pairs_up("after add_process_set")  # (the sets go with the restart after this test)
    for c in (sub, sub_dup):
        c.Free()
