"""Adding and removing process sets: agreed by every rank through the engine, like any collective."""
from __future__ import annotations

from typing import Any

from .api import _auto_name, _submit
from .process_sets import ProcessSet, comm_ranks, normalize_ranks
from .runtime import state


# -- process sets -------------------------------------------------------------------------------------
def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    st = state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.mpi_comm is not None and ps.ranks is None:
        ps.ranks = _agreed_comm_ranks(ps, st)
    ranks = normalize_ranks(ps)
    bad = [r for r in ranks if not 0 <= r < st.size]
    if bad:
        raise ValueError(f"add_process_set: ranks {bad} do not exist in a job of {st.size} ranks")
    if st.psets.find(ranks) is not None:
        raise ValueError(f"add_process_set: a process set with ranks {ranks} is already registered")
    name = _auto_name("add_process_set", None)
    ps_id = _submit("add_process_set", name, 0, [], [], extra=tuple(ranks)).wait()
    return st.psets.register(ps, int(ps_id))


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
    st = state()
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or ps_id not in st.psets.ranks:
        return False
    name = _auto_name("remove_process_set", None)
    _submit("remove_process_set", name, 0, [], [], extra=int(ps_id)).wait()
    return True
