"""Adasum: adaptive summation of gradients (Maleki et al., MLSys 2021) over MPI point-to-point.

For two vectors a and b, ``adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: orthogonal
vectors add, identical ones average. Over 2^k ranks it is applied pairwise in a tree by vector halving and
distance doubling: at level d = 1, 2, 4... a rank swaps half of its current range with the rank ``rank ^ d``,
the dot products and norms of the two full vectors are summed over the 2d ranks that hold pieces of them,
and each rank combines its half. The halves are then exchanged back in reverse order, so every rank ends
with the whole result.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .chunks import swap

_TAG = 0x5ADA


class LevelComms:
    """For each tree level d of a communicator, the communicator of the 2d ranks sharing ``rank // 2d``, made on
    first use (every member runs the same Adasum op at the same point, so the splits match)."""

    def __init__(self) -> None:
        self._by_comm: dict[int, tuple[Any, list[Any]]] = {}

    def levels(self, comm: Any) -> list[Any]:
        found = self._by_comm.get(id(comm))  # the comm is kept with its levels: its id is not reused meanwhile
        if found is None:
            size, rank = comm.Get_size(), comm.Get_rank()
            levels, d = [], 1
            while d < size:
                levels.append(comm.Split(rank // (2 * d), key=rank))
                d *= 2
            found = self._by_comm[id(comm)] = (comm, levels)
        _, levels = found
        return levels

    def free(self) -> None:
        for _, levels in self._by_comm.values():
            for c in levels:
                c.Free()
        self._by_comm.clear()


def reduce(comm: Any, level_comms: list[Any], buf: np.ndarray, bounds: list[tuple[int, int]],
           sum_op: Any, float64: Any, wait: Callable[[Any], None]) -> None:
    """Adasum-reduce ``buf`` (float32 or float64, 1-D, identical length on every rank) in place; each tensor's
    [start, end) of ``bounds`` is its own vector, whose dot products and norms ``sum_op`` sums in float64."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = 0, buf.size
    recv = np.empty_like(buf)
    history: list[tuple[int, bool, int, int, int]] = []  # (neighbour, left, range lo, mid, hi) per level
    d, level = 1, 0
    while d < size:
        neighbour = rank ^ d
        mid = lo + (hi - lo) // 2
        left = rank & d == 0  # the left rank keeps the first half and holds "a"
        keep_lo, keep_hi = (lo, mid) if left else (mid, hi)
        give_lo, give_hi = (mid, hi) if left else (lo, mid)
        wait(swap(comm, buf[give_lo:give_hi], recv[keep_lo:keep_hi], neighbour, _TAG + level))
        mine, theirs = buf[keep_lo:keep_hi], recv[keep_lo:keep_hi]
        a, b = (mine, theirs) if left else (theirs, mine)
        parts = _partials(a, b, keep_lo, bounds)
        totals = np.empty_like(parts)
        wait(level_comms[level].Iallreduce([parts, float64], [totals, float64], sum_op))
        _combine(a, b, mine, keep_lo, bounds, totals)
        history.append((neighbour, left, lo, mid, hi))
        lo, hi = keep_lo, keep_hi
        d *= 2
        level += 1
    for level in reversed(range(len(history))):
        neighbour, left, lo, mid, hi = history[level]
        (keep_lo, keep_hi), (other_lo, other_hi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        wait(swap(comm, buf[keep_lo:keep_hi], buf[other_lo:other_hi], neighbour, _TAG + 64 + level))


def _overlaps(lo: int, hi: int, bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(tensor index, start, end) of each tensor's part inside [lo, hi), relative to lo."""
    out = []
    for i, (s, e) in enumerate(bounds):
        a, b = max(s, lo), min(e, hi)
        if a < b:
            out.append((i, a - lo, b - lo))
    return out


def _partials(a: np.ndarray, b: np.ndarray, lo: int, bounds: list[tuple[int, int]]) -> np.ndarray:
    """Per tensor: this rank's share of a.b, |a|^2 and |b|^2, in float64."""
    parts = np.zeros((len(bounds), 3), dtype=np.float64)
    for i, s, e in _overlaps(lo, lo + a.size, bounds):
        x = a[s:e].astype(np.float64, copy=False)
        y = b[s:e].astype(np.float64, copy=False)
        parts[i] = (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return parts.reshape(-1)


def _combine(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, bounds: list[tuple[int, int]],
             totals: np.ndarray) -> None:
    sums = totals.reshape(-1, 3)
    for i, s, e in _overlaps(lo, lo + a.size, bounds):
        dot, anorm, bnorm = sums[i]
        acoeff = 1.0 - dot / (2.0 * anorm) if anorm > 0 else 1.0
        bcoeff = 1.0 - dot / (2.0 * bnorm) if bnorm > 0 else 1.0
        result = acoeff * a[s:e].astype(np.float64) + bcoeff * b[s:e].astype(np.float64)
        out[s:e] = result
