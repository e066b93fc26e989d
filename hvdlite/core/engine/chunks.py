"""Chunked reductions, several chunks in flight: each chunk is scaled as it completes while later ones travel.

Every rank starts the same chunks in the same order (agreed batches), so the collectives match whatever the depth
in flight: it changes only when this rank waits, never what is sent.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import numpy as np

from ..reduce_ops import scale_inplace

IN_FLIGHT = 4  # chunk collectives outstanding at once (measurements: benchmarks/HISTORY.md)


def shortest_fast_length(ranks: int) -> int:
    """The fewest elements for which Open MPI's Rabenseifner iallreduce takes 2 log2(p) steps: the largest power of
    two <= ``ranks`` (1 below 4 ranks); a shorter vector goes round its ring, 2(p-1) steps."""
    largest = 1 << (max(1, ranks).bit_length() - 1)
    return largest if largest >= 4 else 1


def start_allreduce(comm: Any, tree: bool, send: Any, recv: np.ndarray, datatype: Any, op: Any,
                    wait: Callable[[Any], None]) -> Any:
    """Start an all-reduce of ``recv`` (``send``: a buffer or IN_PLACE; ``datatype`` None: numpy's); its request.
    With ``tree`` (Open MPI) a vector shorter than shortest_fast_length is a binomial reduce to rank 0 and a
    broadcast (docs/ARCHITECTURE.md); rank 0 completes its reduce before the broadcast: one order on every rank."""
    spec = recv if datatype is None else [recv, datatype]
    count = recv.size if datatype is None else recv.nbytes // datatype.Get_size()
    if not tree or count >= shortest_fast_length(comm.Get_size()) or type(comm).__module__ != "mpi4py.MPI":
        return comm.Iallreduce(send, spec, op)  # a wrapping communicator (deterministic.py) reduces its own way
    if comm.Get_rank() == 0:
        wait(comm.Ireduce(send, spec, op=op, root=0))
        return comm.Ibcast(spec, root=0)
    if not isinstance(send, (np.ndarray, list)):  # IN_PLACE: the broadcast will write where the reduce reads
        send = recv.copy() if datatype is None else [recv.copy(), datatype]
    return _Both((comm.Ireduce(send, None, op=op, root=0), comm.Ibcast(spec, root=0)), send)


class _Both(NamedTuple):
    """Two requests completed together (and the buffer the first reads, kept alive until then)."""

    requests: tuple[Any, Any]
    keep: Any

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return all([request.Test() for request in self.requests])  # a list: each is tested, so each progresses


def swap(comm: Any, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> _Both:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it: one request."""
    return _Both((comm.Isend(send, peer, tag), comm.Irecv(recv, peer, tag)), None)


def halves(comm: Any, piece: np.ndarray, factor: float, spares: list[np.ndarray]) -> Iterator[bool]:
    """At 2 ranks, an in-place float32/64 sum then scaled by ``factor`` (Average's division) as two exchanges of
    halves: each rank adds its peer's part of its half into it and scales it in cache (after an Iallreduce each rank
    divides all of it), then they swap halves: Iallreduce's bits then scale_inplace's. Yields False until done."""
    peer, half = 1 - comm.Get_rank(), (piece.shape[0] + 1) // 2
    mine, theirs = (piece[:half], piece[half:]) if peer else (piece[half:], piece[:half])
    spare = spares.pop() if spares else np.empty(0, np.uint8)
    inbox = spare if spare.nbytes >= mine.nbytes else np.empty(mine.nbytes, np.uint8)
    received = inbox[:mine.nbytes].view(piece.dtype)
    first = swap(comm, theirs, received, peer, 0x5A17)  # (the tags of its two exchanges)
    yield False  # started; the steps after are taken in the order the chunks were posted, the same on every rank
    while not first.Test():
        yield False
    np.add(received, mine, out=mine)
    spares.append(inbox)  # read: the next chunk may receive into it
    np.multiply(mine, mine.dtype.type(float(factor)), out=mine)  # (scale_inplace at 2 ranks: a divisor of 2 or none)
    second = swap(comm, mine, theirs, peer, 0x5A18)
    while not second.Test():
        yield False


class _Chunk(NamedTuple):
    """One outstanding chunk collective."""

    request: Any  # the MPI request to wait on
    piece: np.ndarray  # the chunk's memory, multiplied by ``factor`` once the collective completes
    dtype: str
    factor: float
    on_done: Optional[Callable[[], None]]  # runs after the scaling


class ChunkPipeline:
    """The chunk collectives one executor has in flight, completed in the order they were started."""

    def __init__(self, wait: Callable[[Any], None]) -> None:
        self._wait = wait
        self._inflight: collections.deque[_Chunk] = collections.deque()  # outstanding chunks, oldest first
        self._in_wait = False
        self.spares: list[np.ndarray] = []  # halves()' inboxes no chunk receives into (at most IN_FLIGHT)

    def post(self, request: Any, piece: np.ndarray, dtype: str, factor: float,
             on_done: Optional[Callable[[], None]] = None) -> None:
        """Take a started chunk collective (``piece`` scaled by ``factor`` when done, then ``on_done``)."""
        self._inflight.append(_Chunk(request, piece, dtype, factor, on_done))
        while len(self._inflight) >= IN_FLIGHT:
            self._complete_oldest()

    def clear(self, arrays: Iterable[Optional[np.ndarray]]) -> None:
        """Before a tensor is read or written: complete what is in flight if it writes any byte of ``arrays``
        (numpy's bounds check: 0.75 us a pair, against 6.5 us for two __array_interface__ reads; every buffer the
        engine reduces is C-contiguous, so bounds that overlap share bytes)."""
        if self._inflight and any(a is not None and a.nbytes and np.may_share_memory(a, chunk.piece)
                                  for a in arrays for chunk in self._inflight):
            self.drain()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Around one batch: every chunk started inside has completed when it ends without an error."""
        try:
            yield
            self.drain()
        except BaseException:
            self.settle()
            raise

    def drain(self) -> None:
        while self._inflight:
            self._complete_oldest()

    def settle(self) -> None:
        """After an error: complete what is in flight (MPI may still write into those buffers), unless the
        error came from waiting on MPI itself (the job is ending: waiting again could only hang)."""
        if self._in_wait:
            self._inflight.clear()
            self._in_wait = False
            return
        pending = [chunk.request for chunk in self._inflight]
        self._inflight.clear()
        for request in pending:
            self._in_wait = True
            self._wait(request)
            self._in_wait = False

    def _complete_oldest(self) -> None:
        request, piece, dtype, factor, on_done = self._inflight.popleft()
        self._in_wait = True
        self._wait(request)
        self._in_wait = False
        scale_inplace(piece, dtype, factor)  # while the later chunks travel
        if on_done is not None:
            on_done()

