"""Process sets: subsets of ranks that run collectives among themselves."""
from __future__ import annotations

from typing import Any, Optional


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
