"""Which process sets a list of ProcessSets registers, as Horovod's init() and add_process_set() read it.

A ``ProcessSet(comm)`` stands, on each rank, for that rank's own communicator: every rank passes its piece of
one ``Split`` (or MPI.COMM_NULL where it is in none), and the entry registers one set per distinct piece,
gathered from every rank, in the order of their sorted rank lists (Horovod's numbering). The entries built
from communicators come first, in their order, then those built from rank lists. An entry whose set is the
global one, or one an earlier entry of the same list stands for (an equal communicator, a ``Dup``, a rank list
equal to a communicator's group), is a duplicate: refused with ValueError on the ranks whose entry it is, once
the others are registered.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

from .engine import mpi
from .process_sets import ProcessSet, normalize_ranks


class Plan(NamedTuple):
    """What one list of entries asks for: the same ``lists`` on every rank, this rank's ``mine``."""

    lists: list[list[int]]  # every set to register (those not yet registered), in registration order
    mine: list[Optional[list[int]]]  # per entry (the caller's order), the ranks it stands for on this rank


def plan(sets: Sequence[ProcessSet], world: Any, rank: int, size: int, gather: bool) -> Plan:
    """The plan for ``sets``. ``gather``: exchange the communicators' pieces over ``world`` (collective: every
    rank calls with the same number of communicator entries); without it, no entry may hold a communicator."""
    comm_at = [i for i, ps in enumerate(sets) if ps.mpi_comm is not None]
    mine: list[Optional[list[int]]] = [None if ps.mpi_comm is not None else normalize_ranks(ps) for ps in sets]
    for i, ranks in enumerate(mine):
        bad = [r for r in ranks or () if not 0 <= r < size]
        if bad:
            raise ValueError(f"process set entry {i}: ranks {bad} do not exist in a job of {size} ranks")
    pieces = [mpi.communicator_world_ranks(sets[i].mpi_comm, world) for i in comm_at]
    views: list[list[Optional[list[int]]]] = world.allgather(pieces) if gather else [pieces]
    if len({len(view) for view in views}) != 1:
        counts = "; ".join(f"rank {r}: {len(view)}" for r, view in enumerate(views))
        raise ValueError(f"the ranks passed different numbers of communicator-built process sets ({counts}); "
                         f"every rank passes one entry (its piece, or MPI.COMM_NULL) per communicator")
    lists: list[list[int]] = []
    for k, i in enumerate(comm_at):
        distinct = sorted({tuple(piece) for view in views if (piece := view[k]) is not None})
        if not distinct:
            raise ValueError(f"process set entry {i}: every rank passed MPI.COMM_NULL")
        lists += [list(ranks) for ranks in distinct]
        own = pieces[k]
        mine[i] = own if own is not None else (list(distinct[0]) if len(distinct) == 1 else None)
    lists += [ranks for ranks in mine if ranks is not None and ranks not in lists]
    return Plan(lists, mine)


def refusals(sets: Sequence[ProcessSet], mine: list[Optional[list[int]]], ids: list[Optional[int]],
             known_before: set[int], rank: int) -> list[Optional[str]]:
    """Per entry, why this rank refuses it (None: registered as ``ids`` says). An init() entry is a duplicate
    of the global set or of an earlier entry; an add_process_set() entry (``known_before``: the ids registered
    before the call) of any set registered before it."""
    seen = set(known_before) | {0}
    out: list[Optional[str]] = []
    for i, (ps, ranks, ps_id) in enumerate(zip(sets, mine, ids)):
        if ranks is None or ps_id is None:
            out.append(f"entry {i} ({ps!r}) holds MPI.COMM_NULL on rank {rank}, and its communicators make "
                       f"several sets: pass this rank's own piece")
        elif ps_id in seen:
            out.append(f"entry {i} is a duplicate: a process set with ranks {ranks} is already registered "
                       f"(id {ps_id})")
        else:
            seen.add(ps_id)
            out.append(None)
    return out
