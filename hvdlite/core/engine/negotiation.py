"""Negotiation: deciding, identically on every rank, which named requests run this cycle.

Two paths. The full path allgathers every rank's pending (name, signature, age) and decides from
the whole table. The cached path, used in steady state, needs only a bit-vector all-reduce: every
name once agreed keeps a bit, and each rank reports the bits it is *missing*; a bit that no rank is
missing is ready everywhere.
"""
from __future__ import annotations

import dataclasses
import heapq
import pickle
from typing import Any, Iterable, Optional, Sequence, cast

import numpy as np

from . import callsite, polling
from .eviction import LeastRecent
from .mpi import counts_displacements
from .mismatch import describe_mismatch, invalid_argument
from .requests import Kind, Response, Signature

FLAG_FULL = 1        # some rank needs the full path this cycle
FLAG_SHUTDOWN = 2    # some rank is shutting down
FLAG_BUSY = 4        # some rank has requests pending (idle ranks keep cycling promptly)
FLAG_EXCHANGE = 8    # rank 0: exchange straggler times at the next cycle with agreed ops (engine/stragglers.py)
NEGOTIATION_POLL_CAP = 0.001  # seconds between polls of a negotiation message exchange


@dataclasses.dataclass
class RankMessage:
    """What one rank sends on the full path."""

    reqs: list[tuple[str, Signature, float]]  # (name, signature, age in seconds)
    shutdown: bool = False
    join_cycle: int = -1  # cycle at which this rank joined, -1 if it has not
    tune: Optional[dict[Any, Any]] = None  # rank 0 only: autotune settings every rank adopts after this round
    sites: Optional[dict[Any, str]] = None  # (process set, name) -> "file:line" of the user's code that submitted it


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
            self._note = _elsewhere(table, key[0], self.name, self.missing_ranks)
            self._where = _sites(messages, key, self.ready_ranks) + _waiting_instead(messages, self.missing_ranks)

    @property
    def note(self) -> str:
        self._explain()
        return self._note

    @property
    def where(self) -> str:
        self._explain()
        return self._where


class ResponseCache:
    """Names agreed before, each holding one bit. Identical on every rank by construction: it is
    only changed from decisions that every rank reached the same way, in the same order.

    Bit sets are numpy bool arrays of ``64 * words`` entries (``bits()``), packed into uint64 words only
    for the all-reduce, so per-cycle work is a few whole-array operations whatever the number of names.
    """

    def __init__(self, capacity: int, my_rank: int) -> None:
        self.capacity = capacity
        self.my_rank = my_rank
        self.words = (capacity + 63) // 64
        self.by_name: dict[tuple[int, Optional[str]], int] = {}
        self.names: list[Optional[str]] = [None] * capacity
        self.sigs: list[Optional[Signature]] = [None] * capacity
        self.responses: list[Optional[Response]] = [None] * capacity  # reused each time the bit is ready
        self.last_used = [0] * capacity
        self._free = list(range(capacity))  # a heap of the bits not in use: the lowest first
        self._lru = LeastRecent(self.last_used)  # the victim when every bit is in use
        self.member = self.bits()  # bits whose process set includes this rank
        self.valid = self.bits()   # bits in use
        self.version = 0      # bumped when a bit changes meaning
        self.ready_bits = np.zeros(0, dtype=np.intp)  # the bits of the last ready() responses

    def bits(self) -> np.ndarray:
        """An empty bit set."""
        return np.zeros(64 * self.words, dtype=bool)

    def lookup(self, name: str, sig: Signature, key: Optional[tuple[int, str]] = None) -> int:
        """The bit of ``name`` if it was agreed with signature ``sig`` (``key``: its (process set, name), if made)."""
        bit = self.by_name.get((sig.ps_id, name) if key is None else key, -1)
        if bit >= 0 and (self.sigs[bit] is sig or self.sigs[bit] == sig):
            return bit
        return -1

    def put(self, name: str, sig: Signature, members: Sequence[int], tick: int) -> None:
        if self.capacity == 0 or not sig.kind.cacheable:
            return
        key = (sig.ps_id, name)
        bit = self.by_name.get(key, -1)
        if bit < 0:
            if self._free:
                bit = heapq.heappop(self._free)
            else:
                bit = self._lru.victim()  # the least (last_used, bit)
                old = self.sigs[bit]
                assert old is not None  # the cache is full: every bit holds an entry
                del self.by_name[(old.ps_id, self.names[bit])]
            self.by_name[key] = bit
            self.names[bit] = name
        self.sigs[bit] = sig
        self.responses[bit] = Response(name, sig)
        self.last_used[bit] = tick
        self._lru.touched(tick, bit)
        self.version += 1
        self.valid[bit] = True
        self.member[bit] = self.my_rank in members

    def remove_process_set(self, ps_id: int) -> None:
        for bit, sig in enumerate(self.sigs):
            if sig is not None and sig.ps_id == ps_id:
                del self.by_name[(ps_id, self.names[bit])]
                self.names[bit] = None
                self.sigs[bit] = None
                self.responses[bit] = None
                self.member[bit] = False
                self.valid[bit] = False
                heapq.heappush(self._free, bit)
        self.version += 1

    # -- bit-vector encoding ------------------------------------------------------------------
    def encode(self, flags: int, missing: np.ndarray) -> np.ndarray:
        """The all-reduce vector: the flags word, then the ``missing`` bit set packed into words."""
        vec = np.empty(1 + self.words, dtype=np.uint64)
        vec[0] = flags
        vec[1:] = np.packbits(missing, bitorder="little").view(np.uint64)
        return vec

    def decode(self, vec: np.ndarray) -> tuple[int, np.ndarray]:
        return int(vec[0]), np.unpackbits(vec[1:].view(np.uint8), bitorder="little").view(bool)

    def ready(self, missing_anywhere: np.ndarray, tick: int) -> list[Response]:
        """The responses of the entries no rank is missing, in bit order, each marked used at ``tick``."""
        responses, last_used = self.responses, self.last_used
        out = []
        self.ready_bits = np.flatnonzero(self.valid & ~missing_anywhere)  # the responses' bits, in their order
        if tick < self._lru.ready_min:
            self._lru.ready_min = tick
        for bit in self.ready_bits.tolist():
            last_used[bit] = tick
            out.append(responses[bit])
        return cast(list[Response], out)  # valid bits hold a response


class PendingBits:
    """The cache bits of this rank's pending requests, kept up to date as requests come and go (and
    recomputed only when cache bits changed meaning), plus how many pending requests have no bit."""

    def __init__(self, cache: ResponseCache, keep_times: bool = False) -> None:
        self.cache = cache
        self.mine = cache.bits()
        self.uncached = 0  # pending requests without a cache bit: they need a full round
        self.version = -1  # the cache version ``mine`` was computed for
        # with ``keep_times``, each pending request's submission time at its bit (straggler attribution)
        self.submitted: Optional[np.ndarray] = np.zeros(len(self.mine)) if keep_times else None

    def add(self, new: list[Any], pending: dict[Any, Any]) -> np.ndarray:
        """Count ``new`` requests (all of ``pending`` if the cache changed); returns the bit set."""
        cache = self.cache
        if cache.version != self.version:
            self.version = cache.version
            self.mine[:] = False
            self.uncached = 0
            new = list(pending.values())
        lookup, version, bits, times = cache.lookup, self.version, [], []
        keep = self.submitted is not None
        for req in new:
            bit = req.cache_bit = lookup(req.name, req.sig, req.key)
            req.cache_version = version
            if bit < 0:
                self.uncached += 1
            else:
                bits.append(bit)
                if keep:
                    times.append(req.submitted)
        self.mine[bits] = True
        if self.submitted is not None:
            self.submitted[bits] = times
        return self.mine

    def times_of(self, bits: np.ndarray) -> Optional[np.ndarray]:
        """The submission times of the pending requests at ``bits`` (in that order), or None when not kept or
        when some bit has no pending request here."""
        if self.submitted is None or not self.mine[bits].all():
            return None
        times: np.ndarray = self.submitted[bits]
        return times

    def remove(self, req: Any) -> None:
        """A pending request finished."""
        if req.cache_version == self.version:
            if req.cache_bit < 0:
                self.uncached -= 1
            else:
                self.mine[req.cache_bit] = False


def pending_message(pending: Iterable[Any], now: float, **fields: Any) -> RankMessage:
    """This rank's message of a full round: its pending (name, signature, age), their call sites, ``fields``."""
    pending = list(pending)
    return RankMessage([(r.name, r.sig, now - r.submitted) for r in pending], sites=callsite.sites_of(pending),
                       **fields)


def allgather_messages(comm: Any, msg: RankMessage, sizes_out: Optional[list[Any]] = None) -> list[RankMessage]:
    """Every rank's message, in rank order: the sizes, then the pickled bytes, each non-blocking and polled
    (so a slow peer never blocks the engine inside MPI). ``sizes_out`` receives each rank's message size."""
    payload = np.frombuffer(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    size = comm.Get_size()
    sizes = np.empty(size, dtype=np.int64)
    polling.wait(comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes), NEGOTIATION_POLL_CAP)
    if sizes_out is not None:
        sizes_out[:] = sizes.tolist()
    sizes, displs = counts_displacements(sizes)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    polling.wait(comm.Iallgatherv(payload, [data, (sizes, displs)]), NEGOTIATION_POLL_CAP)
    return [pickle.loads(data[d:d + n].tobytes()) for d, n in zip(displs.tolist(), sizes.tolist())]


#: What join() lets run on the other ranks by default (Horovod's rule); allgather and broadcast join them with
#: the join_allows_allgather_broadcast setting.
JOIN_TOLERANT = frozenset({Kind.ALLREDUCE, Kind.BARRIER})
JOIN_TOLERANT_PERMISSIVE = JOIN_TOLERANT | {Kind.ALLGATHER, Kind.BROADCAST}


def decide(messages: Sequence[RankMessage], members_of: dict[int, list[int]], world_size: int,
           join_tolerant: frozenset[Kind] = JOIN_TOLERANT) -> tuple[list[Response], list[Stalled]]:
    """The full path: from every rank's message, the responses to run now and what is stalled.

    Every rank calls this with the same ``messages`` (and the agreed ``join_tolerant``, the kinds that run
    while ranks have joined) and so reaches the same answer.
    """
    joined = {r for r, m in enumerate(messages) if m.join_cycle >= 0}
    # One table per process set: the same name may be in use in several sets at once.
    table: dict[tuple[int, str], dict[int, tuple[Signature, float]]] = {}
    for rank, msg in enumerate(messages):
        for name, sig, age in msg.reqs:
            table.setdefault((sig.ps_id, name), {})[rank] = (sig, age)

    responses: list[Response] = []
    stalled: list[Stalled] = []
    join_name: Optional[str] = None
    for key, entries in table.items():
        ps_id, name = key
        first_sig = entries[min(entries)][0]
        kind = first_sig.kind
        if kind is Kind.JOIN:
            join_name = name
            continue
        members = members_of.get(ps_id)
        if members is None:
            responses.append(Response(name, first_sig, error=f"process set {ps_id} is not registered on "
                                      f"every rank", error_kind="process_set"))
            continue
        present = set(entries)
        stand_ins = frozenset(joined - present) if ps_id == 0 else frozenset()
        if not set(members) <= present | stand_ins:
            missing = sorted(set(members) - present - stand_ins)
            stalled.append(Stalled(name, kind, sorted(present), missing,
                                   max(age for _, age in entries.values()), first_sig, context=(table, messages)))
            continue
        sigs = {rank: sig for rank, (sig, _) in entries.items()}
        error = invalid_argument(name, sigs, members)
        if error is not None:
            responses.append(Response(name, first_sig, error=error + _sites(messages, key, present),
                                      error_kind="invalid"))
            continue
        error = describe_mismatch(name, sigs)
        if error is not None:
            error += _sites(messages, key, present)
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
        sig = table[(0, join_name)][min(table[(0, join_name)])][0]
        responses.append(Response(join_name, sig, last_joined=last))
    return responses, stalled


def _sites(messages: Sequence[RankMessage], key: tuple[int, str], ranks: Iterable[int]) -> str:
    """Where each of ``ranks`` submitted ``key`` in the user's code (from their messages)."""
    return callsite.describe({r: (messages[r].sites or {}).get(key) for r in ranks})


def _waiting_instead(messages: Sequence[RankMessage], missing: list[int], most: int = 3) -> str:
    """What each missing rank had pending instead of a stalled name, with its lines."""
    parts = []
    for rank in missing:
        sites = messages[rank].sites or {}
        pending = [f"{name!r} at {sites.get((sig.ps_id, name), 'an unknown line')}"
                   for name, sig, _ in messages[rank].reqs[:most]]
        more = len(messages[rank].reqs) - most
        listed = ", ".join(pending) + (f" and {more} more" if more > 0 else "")
        parts.append(f" Rank {rank} was waiting on {listed} instead." if pending
                     else f" Rank {rank} had submitted nothing.")
    return "".join(parts)


def _elsewhere(table: dict[tuple[int, str], dict[int, tuple[Signature, float]]], ps_id: int, name: str,
               missing: list[int]) -> str:
    """For a stalled name: which missing ranks have the same name pending under another process set (a
    disagreement on the set, shown in the stall report rather than refused: order differs legally)."""
    notes = []
    for (other_ps, other_name), entries in table.items():
        if other_name == name and other_ps != ps_id:
            used = sorted(r for r in entries if r in missing)
            if used:
                notes.append(f"rank(s) {used} submitted it for process set {other_ps} instead")
    return "; ".join(notes)
