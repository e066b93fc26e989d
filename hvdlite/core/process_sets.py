"""Process sets: subsets of ranks that run collectives among themselves, and which sets a list of them registers.

The rules (Horovod's: a ``Split`` communicator's pieces, their ids, duplicates refused) are in docs/torch.md."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

from .engine import mpi


class ProcessSet:
    """A set of ranks: ``ProcessSet([0, 2])`` or ``ProcessSet(comm)`` (an mpi4py communicator's ranks), usable
    once ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set(...)`` registered it on every rank."""

    def __init__(self, ranks_or_comm: Any = None) -> None:
        self.mpi_comm: Any = None
        self.ranks: Optional[list[int]] = None
        # an mpi4py communicator (duck-typed: frontends never import mpi4py): its ranks are resolved at registration
        if all(hasattr(ranks_or_comm, method) for method in ("Get_group", "Get_size", "Split")):
            self.mpi_comm = ranks_or_comm
        elif ranks_or_comm is not None:
            self.ranks = sorted({int(r) for r in ranks_or_comm})
            if not self.ranks:
                raise ValueError("a process set needs at least one rank")
        self.process_set_id: Optional[int] = None
        self._my_rank: Optional[int] = None  # this process's rank in the global communicator

    def _require(self) -> list[int]:
        if self.process_set_id is None or self.ranks is None:
            raise ValueError(f"{self!r} is not registered: pass it to hvd.init(process_sets=[...]) or "
                             f"hvd.add_process_set() on every rank first")
        return self.ranks

    def size(self) -> int:
        return len(self._require())

    def rank(self) -> int:
        """This process's rank within the set (-1 when it is not a member)."""
        ranks = self._require()
        return ranks.index(self._my_rank) if self._my_rank in ranks else -1

    def included(self) -> bool:
        return self._my_rank in self._require()

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.ranks == other.ranks and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks or ()), self.process_set_id))

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


class Plan(NamedTuple):
    lists: list[list[int]]  # every set to register (those not yet registered), in registration order
    mine: list[Optional[list[int]]]  # per entry (the caller's order), the ranks it stands for on this rank


def plan(sets: Sequence[ProcessSet], world: Any, rank: int, size: int, gather: bool) -> Plan:
    """Which sets ``sets`` registers. ``gather``: exchange the communicators' pieces over ``world`` (collective);
    without it, no entry may hold a communicator."""
    comm_at = [i for i, ps in enumerate(sets) if ps.mpi_comm is not None]
    mine: list[Optional[list[int]]] = [None if ps.mpi_comm is not None else list(ps.ranks or ()) for ps in sets]
    for i, ranks in enumerate(mine):
        if ranks == []:  # ProcessSet() (a ProcessSet of no ranks cannot be made)
            raise ValueError(f"process set entry {i} is the global set, which is always registered")
        bad = [r for r in ranks or () if not 0 <= r < size]
        if bad:
            raise ValueError(f"process set entry {i}: ranks {bad} do not exist in a job of {size} ranks")
    pieces = [mpi.communicator_world_ranks(sets[i].mpi_comm, world) for i in comm_at]
    views: list[list[Optional[list[int]]]] = world.allgather(pieces) if gather else [pieces]
    if len({len(view) for view in views}) != 1:
        raise ValueError(f"the ranks passed different numbers of communicator-built process sets "
                         f"({[len(view) for view in views]}): pass one entry per communicator on every rank")
    lists: list[list[int]] = []
    for k, i in enumerate(comm_at):
        distinct = sorted({tuple(piece) for view in views if (piece := view[k]) is not None})
        if not distinct:
            raise ValueError(f"process set entry {i}: every rank passed MPI.COMM_NULL")
        lists += [list(ranks) for ranks in distinct]
        mine[i] = pieces[k] if pieces[k] is not None else (list(distinct[0]) if len(distinct) == 1 else None)
    lists += [ranks for ranks in mine if ranks is not None and ranks not in lists]
    return Plan(lists, mine)


def refusals(sets: Sequence[ProcessSet], mine: list[Optional[list[int]]], ids: list[Optional[int]],
             known_before: set[int], rank: int) -> list[Optional[str]]:
    """Per entry, why this rank refuses it (None: fine): a duplicate of the global set, of an earlier entry, or
    of a set in ``known_before`` (add_process_set: the ids registered before the call)."""
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
