"""Negotiation: the round protocol and ``decide``, which agree, identically on every rank, what runs this cycle.

Two paths. The full path allgathers every rank's pending (name, signature, age) and decides from
the whole table (``decide``). The cached path, used in steady state, needs only a bit-vector all-reduce:
every name once agreed keeps a bit (engine/cache.py), and each rank reports the bits it is *missing*; a bit
that no rank is missing is ready everywhere. The text of mismatches and stalls is in engine/mismatch.py.
"""
from __future__ import annotations

import pickle
from typing import Any, Collection, Optional, Sequence

import numpy as np

from . import callsite, polling
from .mpi import counts_displacements
from .mismatch import describe_mismatch, invalid_argument, submitted_at, used_elsewhere, waiting_instead
from .requests import Kind, Response, Signature, shared

FLAG_FULL = 1        # some rank needs the full path this cycle
FLAG_SHUTDOWN = 2    # some rank is shutting down
FLAG_BUSY = 4        # some rank has requests pending (idle ranks keep cycling promptly)
FLAG_EXCHANGE = 8    # rank 0: exchange straggler times at the next cycle with agreed ops (engine/stragglers.py)
NEGOTIATION_POLL_CAP = 0.001  # seconds between polls of a negotiation message exchange

__all__ = ["FLAG_BUSY", "FLAG_EXCHANGE", "FLAG_FULL", "FLAG_SHUTDOWN", "JOIN_TOLERANT", "JOIN_TOLERANT_PERMISSIVE",
           "RankMessage", "Stalled", "allgather_messages", "decide", "pending_message"]


class RankMessage:
    """What one rank sends on the full path: its pending requests as parallel lists (names; for each an index
    into the message's distinct signatures, its age in seconds, an index into its distinct call-site texts or
    -1), then the round's own fields. A round of 1,000 new names from one line with one signature thus pickles
    1,000 strings, a few numbers each and one signature, not 1,000 tuples and signatures (see ``decide``)."""

    __slots__ = ("names", "sig_index", "sigs", "ages", "site_index", "site_texts", "shutdown", "join_cycle", "tune",
                 "_by_key")

    def __init__(self, reqs: Sequence[tuple[str, Signature, float]] = (), shutdown: bool = False,
                 join_cycle: int = -1, tune: Optional[dict[Any, Any]] = None,
                 sites: Optional[dict[tuple[int, str], str]] = None) -> None:
        """From (name, signature, age) triples and a (process set, name) -> "file:line" table (tests, tools);
        the engine builds its messages with ``pending_message``."""
        sigs: list[Signature] = []
        index_of: dict[int, int] = {}
        self.names = [name for name, _, _ in reqs]
        self.sig_index = [_index(index_of, sigs, sig) for _, sig, _ in reqs]
        self.sigs = sigs
        self.ages = [age for _, _, age in reqs]
        texts = list(dict.fromkeys((sites or {}).values()))
        text_index = {text: i for i, text in enumerate(texts)}
        self.site_index = [text_index.get((sites or {}).get((sig.ps_id, name), ""), -1) for name, sig, _ in reqs]
        self.site_texts = texts
        self.shutdown = shutdown
        self.join_cycle = join_cycle  # cycle at which this rank joined, -1 if it has not
        self.tune = tune  # rank 0 only: autotune settings every rank adopts after this round
        self._by_key: Optional[dict[tuple[int, str], int]] = None  # made on the receiving side when an error reads it

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.names, self.sig_index, self.sigs, self.ages, self.site_index, self.site_texts, self.shutdown,
                self.join_cycle, self.tune)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self.names, self.sig_index, sigs, self.ages, self.site_index, self.site_texts, self.shutdown,
         self.join_cycle, self.tune) = state
        self.sigs = [shared(sig) for sig in sigs]  # equal signatures of every rank are one object: ``is`` agrees
        self._by_key = None

    def signatures(self) -> list[Signature]:
        """Each request's signature, in order."""
        sigs = self.sigs
        return [sigs[i] for i in self.sig_index]

    @property
    def reqs(self) -> list[tuple[str, Signature, float]]:
        """(name, signature, age) of each request, in order (error text)."""
        return list(zip(self.names, self.signatures(), self.ages))

    def site(self, key: tuple[int, str]) -> Optional[str]:
        """The "file:line" where this rank submitted ``key`` (process set, name), if known (error text)."""
        if self._by_key is None:
            self._by_key = {(sig.ps_id, name): i for i, (name, sig) in enumerate(zip(self.names, self.signatures()))}
        index = self._by_key.get(key, -1)
        text_index = self.site_index[index] if index >= 0 else -1
        return self.site_texts[text_index] if text_index >= 0 else None


def _index(index_of: dict[int, int], sigs: list[Signature], sig: Signature) -> int:
    """``sig``'s position in ``sigs``, appended when new (by identity: equal local signatures are mostly shared)."""
    index = index_of.get(id(sig))
    if index is None:
        index = index_of[id(sig)] = len(sigs)
        sigs.append(sig)
    return index


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
            self._note = used_elsewhere(table, key[0], self.name, self.missing_ranks)
            self._where = submitted_at(messages, key, self.ready_ranks) + waiting_instead(messages, self.missing_ranks)

    @property
    def note(self) -> str:
        self._explain()
        return self._note

    @property
    def where(self) -> str:
        self._explain()
        return self._where


def pending_message(pending: Collection[Any], now: float, **fields: Any) -> RankMessage:
    """This rank's message of a full round: its pending requests (names, signatures, ages, call sites), ``fields``."""
    msg = RankMessage(**fields)
    sigs: list[Signature] = []
    index_of: dict[int, int] = {}  # id(signature) -> its index (one loop, no call per request: 1,000 per round)
    sig_index = []
    for req in pending:
        index = index_of.get(id(req.sig))
        if index is None:
            index = index_of[id(req.sig)] = len(sigs)
            sigs.append(req.sig)
        sig_index.append(index)
    msg.names = [req.name for req in pending]
    msg.sig_index = sig_index
    msg.sigs = sigs
    msg.ages = [now - req.submitted for req in pending]
    msg.site_index, msg.site_texts = callsite.site_table(pending)
    return msg


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
