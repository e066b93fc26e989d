"""The engine's table of process sets (members, communicators; changed only by agreed ops) and an engine's scope."""
from __future__ import annotations

from typing import Any, Callable, Optional

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
        self.partial_sets: set[int] = set()  # the sets that leave ranks out: their members' own engine agrees them
        #: told (kind, set id) when a set was added (after its communicators exist) or is about to be removed
        self.on_change: Optional[Callable[[Kind, int], None]] = None
        global_process_set.ranks = list(range(world_size))
        global_process_set._my_rank = world_rank

    def members(self, ps_id: int) -> list[int]:
        return self.ranks.get(ps_id, [])

    def partial(self, ps_id: int) -> bool:
        return ps_id in self.partial_sets

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
        return next((ps_id for ps_id, members in self.ranks.items() if members == ranks), None)

    def apply(self, kind: Kind, extra: Any, world_comm: Any) -> int:
        """Run a process-set change agreed by every rank (engine thread only)."""
        if kind is Kind.ADD_PROCESS_SET:
            ranks = list(extra)
            ps_id = self.next_id
            self.next_id += 1
            self.ranks[ps_id] = ranks
            self.comms[ps_id] = mpi.split_member(world_comm, self.world_rank in ranks, self.world_rank)
            if len(ranks) < self.world_size:
                self.partial_sets.add(ps_id)
            if self.on_change is not None:
                self.on_change(kind, ps_id)
            return ps_id
        ps_id = int(extra)
        if self.on_change is not None:
            self.on_change(kind, ps_id)
        self.partial_sets.discard(ps_id)
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


class Scope:
    """The ranks one engine negotiates among: the whole job's (``ps_id`` None) or a partial set's members (its
    own engine). Ranks are the job's; ``local``: on the comm."""

    def __init__(self, registry: Registry, ps_id: Optional[int] = None) -> None:
        self.registry = registry
        self.ps_id = ps_id
        self.members = registry.ranks[ps_id] if ps_id is not None else []
        self.proposer = min(self.members) if self.members else 0

    def agrees(self, ps_id: int) -> bool:
        """Whether this engine agrees the set's ops (registered, and partial exactly in a partial set's engine)."""
        if self.ps_id is None:
            return ps_id in self.registry.ranks and not self.registry.partial(ps_id)
        return ps_id == self.ps_id

    def local(self, rank: int) -> int:
        return rank if self.ps_id is None else self.members.index(rank)

    def job_ranks(self, by_local: list[Any], empty: Callable[[], Any]) -> list[Any]:
        """One item per rank of the job (``empty()`` for a non-member) from one per rank of the engine's comm."""
        if self.ps_id is None:
            return by_local
        out = [empty() for _ in range(self.registry.world_size)]
        for item, rank in zip(by_local, self.members):
            out[rank] = item
        return out
