"""Adding and removing process sets: agreed by every rank through the engine, like any collective."""
from __future__ import annotations

from typing import Any

from .process_sets import ProcessSet
from .runtime import state


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    return state().add_process_set(process_set)


def _agreed_comm_ranks(ps: ProcessSet, st: Any) -> list[int]:
    """The ranks of a communicator-built set, as its members see them (non-members hold COMM_NULL)."""
    from .objects import allgather_object
    views = allgather_object(comm_ranks(ps.mpi_comm, st.world))
    members = {tuple(v) for v in views if v is not None}
    if len(members) != 1:
        detail = "no rank is a member" if not members else \
            "; ".join(f"rank {r}: {v}" for r, v in enumerate(views) if v is not None)
        raise ValueError(f"add_process_set(ProcessSet(comm)): the communicators disagree ({detail}); every "
                         f"member must pass the same communicator (non-members MPI.COMM_NULL), one ProcessSet "
                         f"per communicator")
    return list(members.pop())


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all ranks must call this). Returns True if removed."""
    return state().remove_process_set(process_set)
