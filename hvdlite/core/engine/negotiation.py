"""Negotiation: the round's flags and the explaining round (``decide``): every rank agrees, identically, what runs.

A cycle's bit-vector all-reduce (engine/cache.py) agrees names seen before; new ones take a vote (vote.py); only
a mismatch, a stall check, join, shutdown or autotune's switch gathers every rank's table here."""
from __future__ import annotations

import pickle
from typing import Any, Optional, Sequence

import numpy as np

from . import polling
from .messages import RankMessage
from .mpi import counts_displacements
from .mismatch import describe_mismatch, invalid_argument, submitted_at, used_elsewhere, waiting_instead
from .requests import Kind, Response, Signature

FLAG_FULL = 1        # some rank has requests without a cache bit: a vote this cycle (engine/vote.py)
FLAG_SHUTDOWN = 2    # some rank is shutting down
FLAG_BUSY = 4        # some rank has requests pending (idle ranks keep cycling promptly)
FLAG_EXCHANGE = 8    # rank 0: exchange straggler times at the next cycle with agreed ops (engine/stragglers.py)
FLAG_EXPLAIN = 16    # some rank needs the explaining round (stall check, join, shutdown, autotune's switch)
NEGOTIATION_POLL_CAP = 0.001  # seconds between polls of a negotiation message exchange

__all__ = ["FLAG_BUSY", "FLAG_EXCHANGE", "FLAG_EXPLAIN", "FLAG_FULL", "FLAG_SHUTDOWN",
           "JOIN_TOLERANT", "JOIN_TOLERANT_PERMISSIVE", "Stalled", "allgather_messages", "decide"]


class Stalled:
    """A name some members of its set have not submitted yet. Its ``note`` (the set the missing ranks used it in)
    and ``where`` (lines, what the missing ranks waited on instead) are worked out when a warning reads them."""

    __slots__ = ("name", "kind", "ready_ranks", "missing_ranks", "age", "sig", "again", "_note", "_where", "_context")

    def __init__(self, name: str, kind: Kind, ready_ranks: list[int], missing_ranks: list[int], age: float,
                 sig: Signature, context: Any, again: bool = False) -> None:
        self.name, self.kind, self.sig, self.age, self.again = name, kind, sig, age, again  # again: from a loop
        self.ready_ranks, self.missing_ranks = ready_ranks, missing_ranks
        self._note: Optional[str] = None
        self._where = ""
        self._context = context  # (the round's table, its messages): what note and where are made from

    @property
    def note(self) -> str:
        if self._note is None:
            table, messages = self._context
            key = (self.sig.ps_id, self.name)
            self._note = used_elsewhere(table, messages, key[0], self.name, self.missing_ranks)
            self._where = submitted_at(messages, key, self.ready_ranks) + waiting_instead(messages, self.missing_ranks)
        return self._note

    @property
    def where(self) -> str:
        return self._where if self.note is not None else ""  # note works out both


def allgather_messages(comm: Any, msg: RankMessage, sizes_out: Optional[list[Any]] = None) -> list[RankMessage]:
    """Every rank's message, in rank order: the sizes (into ``sizes_out``), then the bytes, each an arrival wait."""
    payload = np.frombuffer(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    size = comm.Get_size()
    sizes = np.empty(size, dtype=np.int64)
    polling.wait(comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes), NEGOTIATION_POLL_CAP,
                 arrival=True)
    if sizes_out is not None:
        sizes_out[:] = sizes.tolist()
    sizes, displs = counts_displacements(sizes)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    polling.wait(comm.Iallgatherv(payload, [data, (sizes, displs)]), NEGOTIATION_POLL_CAP, arrival=True)
    return [pickle.loads(data[d:d + n].tobytes()) for d, n in zip(displs.tolist(), sizes.tolist())]


#: What join() lets run on the other ranks by default (Horovod's rule); allgather and broadcast join them with
#: the join_allows_allgather_broadcast setting.
JOIN_TOLERANT = frozenset({Kind.ALLREDUCE, Kind.BARRIER})
JOIN_TOLERANT_PERMISSIVE = JOIN_TOLERANT | {Kind.ALLGATHER, Kind.BROADCAST}


def decide(messages: Sequence[RankMessage], members_of: dict[int, list[int]], world_size: int,
           join_tolerant: frozenset[Kind] = JOIN_TOLERANT) -> tuple[list[Response], list[Stalled]]:
    """From every rank's message, the responses to run now and what is stalled; every rank calls it with the same
    ``messages`` and agreed ``join_tolerant`` (the kinds that run while ranks have joined): the same answer."""
    joined = {r for r, m in enumerate(messages) if m.join_cycle >= 0}
    responses: list[Response] = []
    # One table per process set: the same name may be in use in several sets at once. Each entry maps the ranks
    # that submitted the name, in rank order, to the request's position in their message.
    sigs_of = [msg.signatures() for msg in messages]
    table: dict[tuple[int, str], dict[int, int]] = {}
    for rank, msg in enumerate(messages):
        for index, (name, sig) in enumerate(zip(msg.names, sigs_of[rank])):
            table.setdefault((sig.ps_id, name), {})[rank] = index

    stalled: list[Stalled] = []
    join_name: Optional[str] = None
    for key, entries in table.items():
        ps_id, name = key
        first_rank = next(iter(entries))  # the lowest: ranks were entered in order
        first_sig = sigs_of[first_rank][entries[first_rank]]
        kind = first_sig.kind
        if kind is Kind.JOIN:
            join_name = name
            continue
        members = members_of.get(ps_id)
        # The usual case, decided without building sets: every member submitted the name with one signature
        # (received signatures are shared, so equal ones are identical) of a kind with no argument to check.
        # Loops, not all() over generators: a round may hold 1,000 names, and a generator costs a frame each.
        if members is not None and len(entries) == len(members) and kind is not Kind.BROADCAST:
            usual = True
            for rank, index in entries.items():
                if sigs_of[rank][index] is not first_sig:
                    usual = False
                    break
            if usual and ps_id != 0:  # the global set's members are every rank: as many entries are all of them
                for rank in members:
                    if rank not in entries:
                        usual = False
                        break
            if usual:
                responses.append(Response(name, first_sig))
                continue
        if members is None:
            responses.append(Response(name, first_sig, error=f"process set {ps_id} is not registered on "
                                      f"every rank", error_kind="process_set"))
            continue
        present = set(entries)
        stand_ins = frozenset(joined - present) if ps_id == 0 else frozenset()
        if not set(members) <= present | stand_ins:
            missing = sorted(set(members) - present - stand_ins)
            age = max(messages[rank].ages[index] for rank, index in entries.items())
            stalled.append(Stalled(name, kind, sorted(present), missing, age, first_sig, (table, messages),
                                   all(index in messages[rank].again for rank, index in entries.items())))
            continue
        sigs = {rank: sigs_of[rank][index] for rank, index in entries.items()}
        error = invalid_argument(name, sigs, members)
        if error is not None:
            responses.append(Response(name, first_sig, error=error + submitted_at(messages, key, present),
                                      error_kind="invalid"))
            continue
        error = describe_mismatch(name, sigs)
        behind = {r for r in entries if error is not None and entries[r] in messages[r].again}  # still in a loop
        if behind and present - behind and not {sigs[r] for r in behind} & {sigs[r] for r in present - behind}:
            responses.append(Response(name, first_sig, f"{error}{submitted_at(messages, key, present)} Ranks "
                                      f"{sorted(present - behind)} left the loop ranks {sorted(behind)} are in: "
                                      f"their {kind} waits for these ranks' next one", "behind", frozenset(behind)))
            continue
        if error is not None:
            error += submitted_at(messages, key, present)
        if error is None and stand_ins and kind not in join_tolerant:
            hint = " (HVDLITE_JOIN_ALLOWS_ALLGATHER_BROADCAST=1 lets it run)" * (kind in JOIN_TOLERANT_PERMISSIVE)
            error = (f"{kind} of {name!r} cannot run while ranks {sorted(stand_ins)} have called join() "
                     f"({str(kind).capitalize()} is not supported with Join at this time){hint}")
        if error is None and kind is Kind.BROADCAST and ps_id == 0 and first_sig.root in stand_ins:
            error = (f"broadcast of {name!r} has root rank {first_sig.root}, which has already "
                     f"called join(); the root must not join before its broadcasts")
        # a joined rank never submitted the name: told of it, it skips past it (the ranks' names stay in step)
        responses.append(Response(name, first_sig, error=error, joined=stand_ins,
                                  error_kind="join" if error is not None and stand_ins else "mismatch"))

    if join_name is not None and len(joined) == world_size:
        last = max(joined, key=lambda r: (messages[r].join_cycle, r))
        entries = table[(0, join_name)]
        first_rank = next(iter(entries))
        sig = sigs_of[first_rank][entries[first_rank]]
        responses.append(Response(join_name, sig, last_joined=last))
    return responses, stalled
