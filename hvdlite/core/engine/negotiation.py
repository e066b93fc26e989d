"""Negotiation: the round's flags and the explaining round (``decide``): every rank agrees, identically, what runs.

Three paths, each agreed by every rank from the cycle's first bit-vector all-reduce. The cached path needs only
that all-reduce: every name once agreed keeps a bit (engine/cache.py), and each rank reports the bits it is
*missing*; a bit that no rank is missing is ready everywhere. New names go through a vote (engine/vote.py): one
member of each set proposes, every rank votes with bits, so a rank's bytes do not grow with the job. Only what
needs explaining (a mismatch, a stall check, join, shutdown, an autotune switch) takes the explaining round
here: every rank's whole pending table allgathered (``allgather_messages``) and decided from (``decide``). The
text of mismatches and stalls is in engine/mismatch.py.
"""
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
FLAG_SET_SHIFT = 8   # bits 8..63: the process sets (by position, engine/psets.py) with uncached requests somewhere
NEGOTIATION_POLL_CAP = 0.001  # seconds between polls of a negotiation message exchange

__all__ = ["FLAG_BUSY", "FLAG_EXCHANGE", "FLAG_EXPLAIN", "FLAG_FULL", "FLAG_SET_SHIFT", "FLAG_SHUTDOWN",
           "JOIN_TOLERANT", "JOIN_TOLERANT_PERMISSIVE", "Stalled", "allgather_messages", "decide"]


class Stalled:
    """A name that some members of its set have not submitted yet. Its ``note`` (e.g. the missing ranks used
    the name in another process set) and ``where`` (the submitting ranks' lines, and what the missing ranks
    were waiting on instead) are worked out when first read: in most rounds every such name is merely not
    submitted yet everywhere, and only a stall warning or verdict reads them."""

    __slots__ = ("name", "kind", "ready_ranks", "missing_ranks", "age", "sig", "_note", "_where", "_context")

    def __init__(self, name: str, kind: Kind, ready_ranks: list[int], missing_ranks: list[int], age: float,
                 sig: Optional[Signature] = None, note: str = "", where: str = "", context: Any = None) -> None:
        self.name, self.kind, self.sig, self.age = name, kind, sig, age
        self.ready_ranks, self.missing_ranks = ready_ranks, missing_ranks
        self._note, self._where = note, where
        self._context = context  # (the round's table, its messages): what note and where are made from

    def _explain(self) -> None:
        if self._context is not None:
            table, messages = self._context
            self._context = None
            key = (self.sig.ps_id if self.sig is not None else 0, self.name)
            self._note = used_elsewhere(table, messages, key[0], self.name, self.missing_ranks)
            self._where = submitted_at(messages, key, self.ready_ranks) + waiting_instead(messages, self.missing_ranks)

    @property
    def note(self) -> str:
        self._explain()
        return self._note

    @property
    def where(self) -> str:
        self._explain()
        return self._where


def allgather_messages(comm: Any, msg: RankMessage, sizes_out: Optional[list[Any]] = None) -> list[RankMessage]:
    """Every rank's message, in rank order: the sizes, then the pickled bytes, each non-blocking and polled
    (so a slow peer never blocks the engine inside MPI). ``sizes_out`` receives each rank's message size.
    Both waits are arrival waits (``polling.wait``): they end when the slowest peer's engine gets there, and a
    peer whose training thread computes Python holds its GIL, so its engine can be tens of ms late; spinning
    on meanwhile took a waiting rank's engine to ~30% of a core (``benchmarks/lab/peer_wait.py``)."""
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


def _one_signature_everywhere(messages: Sequence[RankMessage], members_of: dict[int, list[int]],
                              world_size: int) -> Optional[Signature]:
    """The one signature of every rank's requests, when each rank sent requests of the global set with that
    signature only (``decide``'s fast path), of a kind that needs no check name by name."""
    first = messages[0].sigs
    if len(first) != 1:
        return None
    sig = first[0]
    if sig.ps_id != 0 or sig.kind in _CHECKED_KINDS or len(members_of.get(0, ())) != world_size:
        return None
    for msg in messages:
        if len(msg.sigs) != 1 or msg.sigs[0] is not sig:  # received signatures are shared: equal is identical
            return None
    return sig


#: What join() lets run on the other ranks by default (Horovod's rule); allgather and broadcast join them with
#: the join_allows_allgather_broadcast setting.
JOIN_TOLERANT = frozenset({Kind.ALLREDUCE, Kind.BARRIER})
JOIN_TOLERANT_PERMISSIVE = JOIN_TOLERANT | {Kind.ALLGATHER, Kind.BROADCAST}
_CHECKED_KINDS = frozenset({Kind.JOIN, Kind.BROADCAST})  # decided name by name (a join's stand-ins, the root)


def decide(messages: Sequence[RankMessage], members_of: dict[int, list[int]], world_size: int,
           join_tolerant: frozenset[Kind] = JOIN_TOLERANT) -> tuple[list[Response], list[Stalled]]:
    """The full path: from every rank's message, the responses to run now and what is stalled.

    Every rank calls this with the same ``messages`` (and the agreed ``join_tolerant``, the kinds that run
    while ranks have joined) and so reaches the same answer.
    """
    joined = {r for r, m in enumerate(messages) if m.join_cycle >= 0}
    # The fast path: a burst of like ops of the global set (say 1,000 unnamed allreduces of one shape), one
    # signature on every rank. The names every rank sent are agreed at once, in rank 0's order (as below);
    # the others (not submitted everywhere yet) go through the table below, which only stalls them.
    responses: list[Response] = []
    done: Optional[set[str]] = None
    alike = _one_signature_everywhere(messages, members_of, world_size) if not joined else None
    if alike is not None:
        names = messages[0].names
        if all(msg.names == names for msg in messages):  # every rank sent the same names in the same order
            return [Response(name, alike) for name in names], []
        done = set(names).intersection(*(msg.names for msg in messages[1:]))
        responses = [Response(name, alike) for name in names if name in done]
    # One table per process set: the same name may be in use in several sets at once. Each entry maps the ranks
    # that submitted the name, in rank order, to the request's position in their message.
    sigs_of = [msg.signatures() for msg in messages]
    table: dict[tuple[int, str], dict[int, int]] = {}
    for rank, msg in enumerate(messages):
        for index, (name, sig) in enumerate(zip(msg.names, sigs_of[rank])):
            if done is not None and name in done:
                continue
            key = (sig.ps_id, name)
            entries = table.get(key)
            if entries is None:
                table[key] = {rank: index}
            else:
                entries[rank] = index

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
            stalled.append(Stalled(name, kind, sorted(present), missing, age, first_sig, context=(table, messages)))
            continue
        sigs = {rank: sigs_of[rank][index] for rank, index in entries.items()}
        error = invalid_argument(name, sigs, members)
        if error is not None:
            responses.append(Response(name, first_sig, error=error + submitted_at(messages, key, present),
                                      error_kind="invalid"))
            continue
        error = describe_mismatch(name, sigs)
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
