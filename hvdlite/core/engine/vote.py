"""The vote: new names agreed at a cost per rank that does not grow with the job (one proposal in, bits out).

The engine's lowest rank proposes its pending names in submission order (size: one all-reduce; names: one
broadcast); every rank votes two bits a name (missing here / another signature) in one all-reduce. Names no one
misses run, in order; another signature or an unusable argument takes the explaining round (negotiation.py)."""
from __future__ import annotations

import functools
import pickle
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from . import polling
from .chunks import start_allreduce
from .messages import name_table
from .mismatch import invalid_argument
from .negotiation import FLAG_EXPLAIN, FLAG_FULL, NEGOTIATION_POLL_CAP
from .requests import Kind, Request, Response, shared

__all__ = ["Voted", "uncached_flags", "vote"]


class Voted(NamedTuple):
    """The responses to run now (None: something to explain), the bytes this rank received, its MPI calls."""

    responses: Optional[list[Response]]
    received_bytes: int
    calls: int


def uncached_flags(pending: dict[tuple[int, str], Request], agrees: Callable[[int], bool]) -> int:
    """FLAG_FULL for requests here without a cache bit; FLAG_EXPLAIN too if one's set is not this engine's."""
    flags = FLAG_FULL
    for req in pending.values():
        if req.cache_bit < 0 and not agrees(req.sig.ps_id):
            flags |= FLAG_EXPLAIN
    return flags


def vote(comm: Any, mpi: Any, rank: int, proposer: int, members_of: dict[int, list[int]],
         pending: dict[tuple[int, str], Request], skip: set[tuple[int, str]], local: Callable[[int], int]) -> Voted:
    """Agree which of ``proposer``'s pending names run now, but ``skip``'s (agreed this round already); every rank
    of ``comm`` calls it in the same round. Ranks are the job's; ``local`` gives one's rank on ``comm``."""
    mine = b""
    if rank == proposer:
        mine = pickle.dumps(name_table((req.name, req.sig) for key, req in pending.items()
                                       if key not in skip and req.sig.kind is not Kind.JOIN), protocol=5)
    wait = functools.partial(polling.wait, cap=NEGOTIATION_POLL_CAP, arrival=True)
    size = np.array([len(mine)], dtype=np.int64)
    wait(start_allreduce(comm, mpi.tree, np.array(size), size, None, mpi.MPI.MAX, wait))
    if not size[0]:  # nothing proposed
        return Voted([], 8, 1)
    buf = np.frombuffer(mine, dtype=np.uint8).copy() if mine else np.empty(int(size[0]), dtype=np.uint8)
    wait(comm.Ibcast(buf, root=local(proposer)))
    names, index, sigs = pickle.loads(buf.tobytes())
    sigs = [shared(sig) for sig in sigs]  # equal signatures are one object: ``is`` decides the usual case
    count, words = len(names), (len(names) + 63) // 64
    bits = np.zeros(2 * 64 * words, dtype=bool)  # the missing bits, then the other-signature bits
    for j, (name, i) in enumerate(zip(names, index)):
        sig = sigs[i]
        if rank in members_of.get(sig.ps_id, ()):  # a non-member has no say
            req = pending.get((sig.ps_id, name))
            if req is None:
                bits[j] = True
            elif req.sig is not sig and req.sig != sig:
                bits[64 * words + j] = True
    vec = np.packbits(bits, bitorder="little").view(np.uint64)
    result = np.empty_like(vec)
    wait(start_allreduce(comm, mpi.tree, vec, result, None, mpi.BOR, wait))
    received = 8 + int(size[0]) + result.nbytes
    bits = np.unpackbits(result.view(np.uint8), bitorder="little").view(bool)
    if bits[64 * words:64 * words + count].any():
        return Voted(None, received, 3)  # another signature somewhere: the explaining round says which
    responses = []
    for j in np.flatnonzero(~bits[:count]).tolist():
        sig = sigs[index[j]]
        if sig.kind is Kind.BROADCAST and invalid_argument(names[j], {0: sig}, members_of.get(sig.ps_id, [])):
            return Voted(None, received, 3)  # an argument no member can use: explained with the members' lines
        responses.append(Response(names[j], sig))
    return Voted(responses, received, 3)
