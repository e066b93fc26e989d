"""The vote: new names agreed at a cost per rank that does not grow with the job (one proposal in, bits out).

A round with requests that have no cache bit (engine/cache.py) does not gather every rank's pending table. For
each process set with such requests somewhere (the round's flags say which), its lowest member proposes what it
has pending in that set, in its submission order (every name that can run now is pending on every member, that
one included); every rank receives the proposals (their sizes in one all-reduce, then one broadcast a proposer:
one, rank 0, in the whole job's engine; the set's lowest member in a partial set's own) and votes with two bits per
proposed name in one all-reduce: missing here, or here with a different signature. A name no member is missing,
with one signature everywhere, runs now, in proposal order; a name some member is missing waits (the stall
inspector's explaining round names the missing ranks when it is due). A different signature, or an argument no
member can use, is what needs words: the round then takes the explaining path (negotiation.decide), which
names the field, the ranks and their lines, identically on every rank. Each rank thus sends and receives the
proposals' bytes plus 2 bits per name, whatever the number of ranks.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from . import polling
from .mismatch import invalid_argument
from .negotiation import FLAG_EXPLAIN, FLAG_FULL, FLAG_SET_SHIFT
from .requests import Kind, Request, Response, Signature, shared

__all__ = ["Voted", "uncached_flags", "vote"]

POLL_CAP = 0.001  # seconds between polls (as negotiation's exchanges)


class Voted(NamedTuple):
    """A vote's outcome: the responses to run now (None: something to explain, take the explaining round),
    the bytes this rank received (the proposals' sizes, the proposals, the vote) and its MPI calls."""

    responses: Optional[list[Response]]
    received_bytes: int
    calls: int


def uncached_flags(pending: dict[tuple[int, str], Request], slot: Callable[[int], int]) -> int:
    """This rank's round flags for its requests without a cache bit: FLAG_FULL and the bit of each of their
    sets (``slot``: a set's position, engine/psets.py), or FLAG_EXPLAIN for a set past the flags' bits."""
    flags = FLAG_FULL
    for req in pending.values():
        if req.cache_bit < 0:
            position = slot(req.sig.ps_id)
            flags |= FLAG_EXPLAIN if not 0 <= position < 64 - FLAG_SET_SHIFT else 1 << (FLAG_SET_SHIFT + position)
    return flags


def _proposal(pending: dict[tuple[int, str], Request], sets: set[int], skip: set[tuple[int, str]]) -> bytes:
    """This rank's pending requests of ``sets`` in the order it submitted them (a set's removal after the ops
    submitted before it), but ``skip``'s (agreed already this round), pickled as names, an index into the
    distinct signatures, the signatures (1,000 names of one signature: one signature)."""
    names: list[str] = []
    index: list[int] = []
    sigs: list[Signature] = []
    index_of: dict[int, int] = {}
    for key, req in pending.items():
        if key[0] not in sets or key in skip or req.sig.kind is Kind.JOIN:
            continue
        i = index_of.get(id(req.sig))
        if i is None:
            i = index_of[id(req.sig)] = len(sigs)
            sigs.append(req.sig)
        names.append(req.name)
        index.append(i)
    return pickle.dumps((names, index, sigs), protocol=pickle.HIGHEST_PROTOCOL) if names else b""


def vote(comm: Any, mpi: Any, rank: int, sets: list[int], members_of: dict[int, list[int]],
         pending: dict[tuple[int, str], Request], skip: set[tuple[int, str]], local: Callable[[int], int]) -> Voted:
    """Agree which of the proposed names of ``sets`` (the sets with uncached requests somewhere, in the same
    order on every rank) run now. Every rank of ``comm`` calls it in the same round with the same ``sets`` and
    ``skip``; ranks are the job's, ``local`` gives one's rank on ``comm``."""
    proposer_of = {ps_id: min(members_of[ps_id]) for ps_id in sets}
    proposers = sorted(set(proposer_of.values()))  # the whole job's engine: rank 0 alone; a set's: its lowest
    sizes = np.zeros(len(proposers), dtype=np.int64)
    mine: dict[int, bytes] = {}
    if rank in proposers:
        i = proposers.index(rank)
        mine[i] = _proposal(pending, {ps_id for ps_id, p in proposer_of.items() if p == rank}, skip)
        sizes[i] = len(mine[i])
    total = np.empty_like(sizes)
    polling.wait(comm.Iallreduce(sizes, total, op=mpi.MPI.SUM), POLL_CAP, arrival=True)
    received = total.nbytes
    buffers: list[tuple[int, np.ndarray]] = []
    requests = []
    for i, size in enumerate(total.tolist()):
        if size:
            buf = np.frombuffer(mine[i], dtype=np.uint8).copy() if i in mine else np.empty(size, dtype=np.uint8)
            requests.append(comm.Ibcast(buf, root=local(proposers[i])))
            buffers.append((i, buf))
            received += size
    for request in requests:
        polling.wait(request, POLL_CAP, arrival=True)
    proposed: list[tuple[str, Signature]] = []
    for _, buf in buffers:
        names, index, sigs = pickle.loads(buf.tobytes())
        sigs = [shared(sig) for sig in sigs]  # equal signatures are one object: ``is`` decides the usual case
        proposed.extend((name, sigs[j]) for name, j in zip(names, index))
    calls = 1 + len(requests)
    if not proposed:
        return Voted([], received, calls)
    missing = np.zeros(len(proposed), dtype=bool)
    differs = np.zeros(len(proposed), dtype=bool)
    for j, (name, sig) in enumerate(proposed):
        if rank not in members_of.get(sig.ps_id, ()):
            continue  # a non-member has no say
        req = pending.get((sig.ps_id, name))
        if req is None:
            missing[j] = True
        elif req.sig is not sig and req.sig != sig:
            differs[j] = True
    words = (len(proposed) + 63) // 64
    flags = np.zeros(2 * 64 * words, dtype=bool)  # the missing bits, then the different-signature bits
    flags[:len(proposed)] = missing
    flags[64 * words:64 * words + len(proposed)] = differs
    vec = np.packbits(flags, bitorder="little").view(np.uint64)
    result = np.empty_like(vec)
    polling.wait(comm.Iallreduce(vec, result, op=mpi.BOR), POLL_CAP, arrival=True)
    received += result.nbytes
    bits = np.unpackbits(result.view(np.uint8), bitorder="little").view(bool)
    if bits[64 * words:64 * words + len(proposed)].any():
        return Voted(None, received, calls + 1)  # another signature somewhere: the explaining round says which
    responses = []
    for j in np.flatnonzero(~bits[:len(proposed)]).tolist():
        name, sig = proposed[j]
        if sig.kind is Kind.BROADCAST and invalid_argument(name, {0: sig}, members_of.get(sig.ps_id, [])):
            return Voted(None, received, calls + 1)  # an argument no member can use: explained with their lines
        responses.append(Response(name, sig))
    return Voted(responses, received, calls + 1)

