"""Process sets: subsets of ranks that run collectives among themselves."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence


def is_comm(obj: Any) -> bool:
    """Whether ``obj`` looks like an mpi4py communicator (duck-typed: frontends never import mpi4py)."""
    return hasattr(obj, "Get_group") and hasattr(obj, "Get_size") and hasattr(obj, "Split")


class ProcessSet:
    """A set of ranks. ``ProcessSet([0, 2])`` names ranks of the global communicator;
    ``ProcessSet(comm)`` takes the ranks of an mpi4py communicator (as Horovod's ``ranks_or_comm``).

    It becomes usable after ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set(...)``
    registers it on every rank; ``process_set_id`` is then set.
    """

    def __init__(self, ranks_or_comm: Any = None) -> None:
        self.mpi_comm: Any = None
        self.ranks: Optional[list[int]] = None
        if is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm  # its ranks are resolved when the set is registered
        elif ranks_or_comm is not None:
            self.ranks = sorted({int(r) for r in ranks_or_comm})
            if not self.ranks:
                raise ValueError("a process set needs at least one rank")
        self.process_set_id: Optional[int] = None
        self._my_rank: Optional[int] = None  # this process's rank in the global communicator

    # -- queries (Horovod's names) --------------------------------------------------------------
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


def comm_ranks(comm: Any, world: Any) -> Optional[list[int]]:
    """The ranks of ``world`` that make up communicator ``comm`` (None where this rank holds COMM_NULL)."""
    from mpi4py import MPI  # the core owns MPI; frontends never import it
    if comm == MPI.COMM_NULL:
        return None
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("ProcessSet(comm): the communicator holds processes outside hvdlite's world "
                         "(init(comm=...)); build it from that world")
    return sorted(int(r) for r in ranks)


def normalize_ranks(ranks_or_set: Any) -> list[int]:
    if isinstance(ranks_or_set, ProcessSet):
        if ranks_or_set.ranks is None:
            raise ValueError("the global process set is always registered")
        return list(ranks_or_set.ranks)
    if isinstance(ranks_or_set, Sequence) or hasattr(ranks_or_set, "__iter__"):
        return sorted({int(r) for r in ranks_or_set})
    raise TypeError(f"expected a ProcessSet or a list of ranks, got {type(ranks_or_set).__name__}")


class Registry:
    """The process sets registered on this rank, with the engine's communicator for each."""

    def __init__(self, world_comm: Any, world_rank: int, world_size: int) -> None:
        self.world_rank = world_rank
        self.world_size = world_size
        self.sets: dict[int, ProcessSet] = {0: global_process_set}
        self.comms: dict[int, Any] = {0: world_comm}
        self.ranks: dict[int, list[int]] = {0: list(range(world_size))}
        self.next_id = 1
        global_process_set.ranks = list(range(world_size))
        global_process_set._my_rank = world_rank

    def members_table(self) -> dict[int, list[int]]:
        return self.ranks

    def members(self, ps_id: int) -> list[int]:
        return self.ranks.get(ps_id, [])

    def is_member(self, ps_id: int) -> bool:
        return self.world_rank in self.ranks.get(ps_id, ())

    def comm(self, ps_id: int) -> Any:
        return self.comms[ps_id]

    def size(self, ps_id: int) -> int:
        return len(self.ranks[ps_id])

    def find(self, ranks: list[int]) -> Optional[int]:
        for ps_id, members in self.ranks.items():
            if members == ranks:
                return ps_id
        return None

    def apply(self, kind: str, extra: Any, world_comm: Any) -> int:
        """Run a process-set change agreed by every rank (engine thread only)."""
        if kind == "add_process_set":
            ranks = list(extra)
            ps_id = self.next_id
            self.next_id += 1
            from mpi4py import MPI  # the core owns MPI; frontends never import it
            color = 0 if self.world_rank in ranks else MPI.UNDEFINED
            comm = world_comm.Split(color, key=self.world_rank)
            self.ranks[ps_id] = ranks
            self.comms[ps_id] = comm if comm != MPI.COMM_NULL else None
            return ps_id
        ps_id = int(extra)
        comm = self.comms.pop(ps_id, None)
        if comm is not None:
            comm.Free()
        self.ranks.pop(ps_id, None)
        ps = self.sets.pop(ps_id, None)
        if ps is not None:
            ps.process_set_id = None
        return ps_id

    def register(self, ps: ProcessSet, ps_id: int) -> ProcessSet:
        ps.process_set_id = ps_id
        ps.ranks = self.ranks[ps_id]
        ps._my_rank = self.world_rank
        self.sets[ps_id] = ps
        return ps

    def free(self) -> None:
        for ps_id, comm in list(self.comms.items()):
            if ps_id != 0 and comm is not None:
                comm.Free()
        for ps_id, ps in self.sets.items():
            if ps_id != 0:
                ps.process_set_id = None
