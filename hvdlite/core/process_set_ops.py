"""Adding and removing process sets: agreed by every rank through the engine, like any collective."""
from __future__ import annotations

from typing import Any

from .engine import mpi
from .process_sets import ProcessSet
from .runtime import state


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    return state().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all ranks must call this). Returns True if removed."""
    return state().remove_process_set(process_set)


def process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered process set: id -> its global ranks (the same table on every rank)."""
    return {ps_id: list(ranks) for ps_id, ranks in sorted(state().psets.ranks.items())}



def comm_process_set_id(comm: Any) -> int:
    """The id of the registered set of ``comm``'s ranks, as Horovod's ``_basics._comm_process_set_id``."""
    st = state()
    ranks = mpi.communicator_world_ranks(comm, st.world)
    ps_id = None if ranks is None else st.psets.find(ranks)
    if ps_id is None:
        raise ValueError(f"rank {st.rank}: the MPI communicator (ranks {ranks}) is no registered process set")
    return ps_id
