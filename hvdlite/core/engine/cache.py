"""The response cache: names agreed before, one bit each (unnamed ops: one per stream), and this rank's pending bits."""
from __future__ import annotations

import heapq
from typing import Any, Optional, Sequence, cast

import numpy as np

from .names import generated
from .requests import Response, Signature


class ResponseCache:
    """Names agreed before, each holding one bit, identical on every rank (changed only by agreed decisions); one
    bit per (set, kind) stream of generated names stands for its next name and moves on each time it runs."""

    def __init__(self, capacity: int, my_rank: int) -> None:
        self.capacity = capacity
        self.my_rank = my_rank
        self.words = (capacity + 63) // 64
        self.vector_words = 1 + self.words
        self.by_name: dict[tuple[int, Optional[str]], int] = {}  # (process set, name) -> bit; a stream's next name
        self.streams: dict[tuple[int, str], int] = {}  # (process set, "<kind>[.ps<id>]") -> the bit of its next name
        self.stream_of: dict[int, tuple[int, str]] = {}  # the stream bits, and their stream
        self.names: list[Optional[str]] = [None] * capacity
        self.sigs: list[Optional[Signature]] = [None] * capacity
        self.responses: list[Optional[Response]] = [None] * capacity  # reused each time the bit is ready
        self.last_used = np.zeros(capacity, dtype=np.int64)  # each bit's last tick: the least goes when all are in use
        self._free = list(range(capacity))  # a heap of the bits not in use: the lowest first
        self.member = self.bits()  # bits whose process set includes this rank
        self.valid = self.bits()   # bits in use
        self.global_set = self.bits()  # bits of the global set's names (a rank that joined stands in for them)
        self.version = 0      # bumped when a bit changes meaning
        self.ready_bits = np.zeros(0, dtype=np.intp)  # the bits of the last ready() responses

    def bits(self) -> np.ndarray:
        """An empty bit set."""
        return np.zeros(64 * self.words, dtype=bool)

    def lookup(self, name: str, sig: Signature, key: Optional[tuple[int, str]] = None) -> int:
        """The bit of ``name`` if it was agreed with signature ``sig`` (``key``: its (process set, name), if made)."""
        bit = self.by_name.get((sig.ps_id, name) if key is None else key, -1)  # (a stream's: its next name's)
        if bit >= 0 and (self.sigs[bit] is sig or self.sigs[bit] == sig):
            return bit
        return -1

    def put(self, name: str, sig: Signature, members: Sequence[int], tick: int,
            response: Optional[Response] = None) -> None:
        """Remember ``name`` as agreed with ``sig`` at ``tick``; ``response``: the plain ``Response(name, sig)``
        just agreed, kept instead of a new one (a full round may agree 1,000 new names)."""
        if self.capacity == 0 or not sig.kind.cacheable:
            return
        key = response.key if response is not None else (sig.ps_id, name)
        bit = self.by_name.get(key, -1)
        if bit < 0:
            bit = self._take()
            self.by_name[key] = bit
            self.names[bit] = name
        self._set(bit, sig, response if response is not None else Response(name, sig), members, tick)

    def put_stream(self, name: str, sig: Signature, members: Sequence[int], tick: int) -> None:
        """A generated ``name`` was agreed with ``sig``: its stream's bit stands for the next (or a later one's)."""
        stream, number = generated(name)
        if self.capacity == 0 or not sig.kind.cacheable or number < 0:
            return
        key = (sig.ps_id, stream)
        bit = self.streams.get(key, -1)
        if bit < 0:
            bit = self._take()
            self.streams[key] = bit
            self.stream_of[bit] = key
        elif generated(self.names[bit] or "")[1] > number + 1:
            return
        self._set(bit, sig, self._moved(bit, sig, f"{stream}.noname.{number + 1}"), members, tick)

    def _moved(self, bit: int, sig: Signature, name: str) -> Response:
        """A stream's bit stands for ``name`` now, found in by_name under it (lookup parses no name); its response."""
        self.by_name.pop((sig.ps_id, self.names[bit]), None)
        self.by_name[(sig.ps_id, name)] = bit
        self.names[bit] = name
        return Response(name, sig)

    def _take(self) -> int:
        """A bit for a new entry: the lowest free one, else the least recently used one's (evicted)."""
        if self._free:
            return heapq.heappop(self._free)
        bit = int(np.argmin(self.last_used))  # the least (last_used, bit): argmin takes the first of equals
        self._forget(bit)
        return bit

    def _forget(self, bit: int) -> None:
        old = self.sigs[bit]
        assert old is not None  # an entry in use
        stream = self.stream_of.pop(bit, None)
        if stream is not None:
            del self.streams[stream]
        del self.by_name[(old.ps_id, self.names[bit])]
        self.names[bit] = self.sigs[bit] = self.responses[bit] = None
        self.member[bit] = self.valid[bit] = self.global_set[bit] = False

    def _set(self, bit: int, sig: Signature, response: Response, members: Sequence[int], tick: int) -> None:
        self.sigs[bit] = sig
        self.responses[bit] = response
        self.last_used[bit] = tick
        self.version += 1
        self.valid[bit] = True
        self.member[bit] = self.my_rank in members
        self.global_set[bit] = sig.ps_id == 0

    def remove_process_set(self, ps_id: int) -> None:
        for bit, sig in enumerate(self.sigs):
            if sig is not None and sig.ps_id == ps_id:
                self._forget(bit)
                heapq.heappush(self._free, bit)
        self.version += 1

    # -- bit-vector encoding ------------------------------------------------------------------
    def encode(self, flags: int, missing: np.ndarray) -> np.ndarray:
        """The all-reduce vector: the flags word, then the ``missing`` bit set packed into words."""
        vec = np.zeros(self.vector_words, dtype=np.uint64)
        vec[0] = flags
        vec[1:1 + self.words] = np.packbits(missing, bitorder="little").view(np.uint64)
        return vec

    def decode(self, vec: np.ndarray) -> tuple[int, np.ndarray]:
        return int(vec[0]), np.unpackbits(vec[1:1 + self.words].view(np.uint8), bitorder="little").view(bool)

    def ready(self, missing_anywhere: np.ndarray, tick: int) -> list[Response]:
        """The responses of the entries no rank is missing, in bit order, each marked used at ``tick``."""
        self.ready_bits = np.flatnonzero(self.valid & ~missing_anywhere)  # the responses' bits, in their order
        self.last_used[self.ready_bits] = tick
        responses = self.responses
        out = [responses[bit] for bit in self.ready_bits.tolist()]
        if self.stream_of:
            self._advance()
        return cast(list[Response], out)  # valid bits hold a response

    def _advance(self) -> None:
        """Move each ready stream bit on to its next name (agreed bits: every rank alike); PendingBits looks again."""
        for bit in self.ready_bits.tolist():
            stream, sig = self.stream_of.get(bit), self.sigs[bit]
            if stream is not None and sig is not None:
                following = f"{stream[1]}.noname.{generated(self.names[bit] or '')[1] + 1}"
                self.responses[bit] = self._moved(bit, sig, following)
                self.version += 1


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
