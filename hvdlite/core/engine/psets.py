"""The engine's table of process sets: members and the communicator of each, changed only by agreed ops."""
from __future__ import annotations

from typing import Any, Optional

from ..process_sets import ProcessSet, global_process_set
from . import mpi
from .requests import Kind


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

    def slot(self, ps_id: int) -> int:
        """The set's position among the registered ones (the same on every rank: sets change by agreed ops), or
        -1 if it is not registered here."""
        for slot, registered in enumerate(self.ranks):
            if registered == ps_id:
                return slot
        return -1

    def of_slots(self, mask: int) -> list[int]:
        """The registered sets whose positions are the bits of ``mask``, in order."""
        return [ps_id for slot, ps_id in enumerate(self.ranks) if mask >> slot & 1]

    def has_partial_sets(self) -> bool:
        """True when some registered set leaves out some rank (its ops need non-members in every round)."""
        return any(len(ranks) < self.world_size for ranks in self.ranks.values())

    def only_global(self) -> bool:
        """True while the global set is the only one registered (every op is the global set's)."""
        return len(self.ranks) == 1

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

    def apply(self, kind: Kind, extra: Any, world_comm: Any) -> int:
        """Run a process-set change agreed by every rank (engine thread only)."""
        if kind is Kind.ADD_PROCESS_SET:
            ranks = list(extra)
            ps_id = self.next_id
            self.next_id += 1
            self.ranks[ps_id] = ranks
            self.comms[ps_id] = mpi.split_member(world_comm, self.world_rank in ranks, self.world_rank)
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
