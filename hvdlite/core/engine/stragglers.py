"""Straggler attribution: how late each rank submits each op, measured on each rank's own clock.

Each rank records, per agreed op of the global set, when it submitted it and when it saw the round that agreed
it. That round ends at one moment for every rank, so the median difference of two ranks' agreement times is
their clocks' offset (clocks of different hosts never need to agree); rank r's lateness on an op is its
submission time on rank 0's clock minus the earliest. The ranks exchange these times in a cycle that agrees
ops, before running them: every ``straggler_window_ops`` ops, or after ``straggler_window_seconds`` on rank 0's
clock (its FLAG_EXCHANGE, seen by every rank in one cycle); each keeps the same last window, so ``report()`` is
the same dict on every rank. An op submitted before the ranks first met is start-up, not lateness (NaN, as for
a joined rank); the log line judges only ops agreed STEADY_AFTER_S after that, once there are STEADY_OPS.
"""
from __future__ import annotations

import math
import time
from array import array
from operator import attrgetter
from typing import Any, NamedTuple, Optional

import numpy as np

from ..config import Config
from ..log import logger
from . import polling
from .timeline import Timeline

_KEY = attrgetter("key")
POLL_CAP_S = 1e-4  # every rank starts the exchange in the same cycle: it ends within microseconds
#: The log line judges only ops agreed this long after the ranks first met (the first steps' lazy set-up aside)...
STEADY_AFTER_S = 0.5
#: ... and only once it has this many of them.
STEADY_OPS = 10
#: A rank other than the one named is named after at least this many more ops (or a window, if shorter): time
#: ticks exchange a few ops at a time, and a loaded machine's noise may name a rank before the real straggler.
RENAME_OPS = 100


class Held(NamedTuple):
    """What the ranks exchanged so far, the same on every rank: the last ops' times and the counts."""
    times: np.ndarray  # (rank, submitted|agreed, op) of the last <= straggler_window_ops ops, on each clock
    exchanges: int     # exchanges so far
    ops: int           # agreed ops exchanged so far


class Analysis(NamedTuple):
    """Every rank's lateness on the ops held (those a joined rank stood in for left out)."""
    lateness: np.ndarray  # seconds after the first submission, (rank, op)
    last: np.ndarray      # per rank, the ops it submitted last
    means: np.ndarray     # per rank, the mean lateness in seconds
    straggler: Optional[int]


class Stragglers:
    """Per-op times of this rank, exchanged with every rank's; the report of the last ops exchanged."""

    def __init__(self, config: Config, rank: int, size: int) -> None:
        self.config = config
        self.rank = rank
        self.size = size
        self._submitted = array("d")  # per agreed op, this rank's submission time (NaN: no request here)
        self._agreed = array("d")     # and when its round ended here
        self._stamps: list[float] = []  # timeline time of each op (rank 0 tracing only)
        self._held: Optional[Held] = None  # one assignment per exchange: report() on a user thread sees a whole one
        self._fresh: Optional[tuple[int, list[float]]] = None  # the last exchange's op count and stamps (rank 0)
        self._report: dict[str, Any] = _empty(size, config)
        self._reported: Optional[Held] = None  # the exchange _report was made from
        self._named: Optional[int] = None  # the rank last named in the log
        self._named_at = -1  # the ops exchanged when it was named (-1: never)
        self._due = False  # rank 0 asked for an exchange: the next cycle with agreed ops makes one
        self._met = math.inf  # when this rank's first round agreed ops (the ranks first met), on its clock
        self.windows = 0
        # rank 0's clock: when it raises FLAG_EXCHANGE (inf: never; the loop compares it once per cycle)
        self.tick_at = math.inf
        if rank == 0 and config.straggler_window_ops > 0 and config.straggler_window_seconds > 0:
            self.tick_at = time.monotonic() + config.straggler_window_seconds

    def record(self, responses: list[Any], pending: dict[Any, Any], now: float, timeline: Timeline,
               known: Optional[np.ndarray] = None) -> None:
        """After a round ending at ``now``: the times of each agreed op of the global set (NaN where a joined
        rank had no request), in agreed order. ``known``: the responses' submission times, when every response
        is a good one of the global set with a request here (a cached round, the steady state: the times were
        kept at each request's cache bit, engine/cache.py's PendingBits); else one Python pass."""
        if self.config.straggler_window_ops <= 0:
            return
        self._met = min(self._met, now)
        submitted = self._submitted
        if known is not None:
            submitted.frombytes(known.tobytes())
        else:
            submitted.extend([math.nan if req is None else req.submitted
                              for resp, req in zip(responses, map(pending.get, map(_KEY, responses)))
                              if resp.error is None and resp.key[0] == 0])
        added = len(submitted) - len(self._agreed)
        if added:
            self._agreed += array("d", (now,)) * added
        if timeline.enabled:
            self._stamps += [timeline.now()] * (len(submitted) - len(self._stamps))

    def tick(self) -> None:
        """Every rank, in the cycle whose round carried rank 0's FLAG_EXCHANGE: exchange at the next swap()
        that has ops (rank 0 raises it again only after that exchange)."""
        self._due = True
        self.tick_at = math.inf

    def swap(self, comm: Any) -> None:
        """After a cycle's ops were recorded, before they run (the same cycle on every rank): when a window
        of ``straggler_window_ops`` ops is complete, or rank 0's time tick is due, exchange the ops' times
        with every rank (a full window exactly; after a tick, every op counted) and keep the last window."""
        window = self.config.straggler_window_ops
        count = len(self._submitted)
        if window <= 0 or (count < window and not (self._due and count)):
            return
        count = min(count, window)
        mine = np.empty((2, count), dtype=np.float64)
        mine[0] = np.frombuffer(self._submitted, dtype=np.float64, count=count)  # copies: the arrays shrink
        mine[1] = np.frombuffer(self._agreed, dtype=np.float64, count=count)
        mine[0][mine[0] < self._met] = math.nan  # submitted before the ranks first met: start-up, not lateness
        del self._submitted[:count], self._agreed[:count]
        stamps, self._stamps = self._stamps[:count], self._stamps[count:]
        everyone = np.empty((self.size, 2, count), dtype=np.float64)
        polling.wait(comm.Iallgather(mine, everyone), POLL_CAP_S)
        self.adopt(everyone, stamps)

    def adopt(self, times: np.ndarray, stamps: Optional[list[float]] = None) -> None:
        """Keep every rank's times of newly exchanged ops, (rank, submitted|agreed, op), the same on every
        rank, with the last ones held; rank 0 analyses them after the cycle's ops ran (settle())."""
        held = self._held
        count = times.shape[2]
        ops = count
        if held is not None:
            times = np.concatenate((held.times, times), axis=2)[:, :, -max(self.config.straggler_window_ops, 1):]
            ops += held.ops
        self.windows += 1
        self._held = Held(times, self.windows, ops)
        self._due = False
        if self.rank == 0 and self.config.straggler_window_seconds > 0:
            self.tick_at = time.monotonic() + self.config.straggler_window_seconds
        if self.rank == 0:
            self._fresh = (count, stamps or [])

    def settle(self, timeline: Timeline) -> None:
        """Rank 0, after the cycle of an exchange ran its ops: name a new straggler in one log line, and put
        each new op's lateness per rank on the timeline."""
        fresh, held = self._fresh, self._held
        if fresh is None or held is None:
            return
        self._fresh = None
        count, stamps = fresh
        steady = analyse(held.times[:, :, held.times[0, 1] >= self._met + STEADY_AFTER_S],
                         self.config.straggler_threshold_ms)  # rank 0's agreement times, on its clock
        straggler = steady.straggler
        window = self.config.straggler_window_ops
        ops = steady.lateness.shape[1]
        if straggler is None and ops >= STEADY_OPS:
            self._named = None
        elif straggler is not None and ops >= STEADY_OPS and straggler != self._named and (
                self._named_at < 0 or held.ops - self._named_at >= min(window, RENAME_OPS)):
            logger.warning("rank %d is the straggler: it submitted last in %.0f%% of the last %d ops, "
                           "%.1f ms after the first rank on average (p95 %.1f ms; straggler_threshold_ms=%g). "
                           "hvd.straggler_report() has every rank's figures.", straggler,
                           steady.last[straggler] * 100 / ops, ops, steady.means[straggler] * 1e3,
                           np.percentile(steady.lateness[straggler], 95) * 1e3, self.config.straggler_threshold_ms)
            self._named, self._named_at = straggler, held.ops
        new = held.times[:, :, held.times.shape[2] - count:] if count else held.times[:, :, :0]
        if timeline.enabled and stamps and len(stamps) == new.shape[2] and not np.isnan(new).any():
            result = analyse(held.times, self.config.straggler_threshold_ms)
            lateness = result.lateness[:, result.lateness.shape[1] - len(stamps):]
            for i, ts in enumerate(stamps):
                timeline.counter("LATENESS_MS", ts, {f"rank {r}": round(float(lateness[r, i]) * 1e3, 3)
                                                     for r in range(self.size)})

    def report(self) -> dict[str, Any]:
        """The last ``straggler_window_ops`` ops exchanged (fewer before there were that many): a fresh copy,
        identical on every rank (computed on first ask)."""
        held = self._held
        if held is not None and self._reported is not held:
            result = analyse(held.times, self.config.straggler_threshold_ms)
            ops = result.lateness.shape[1]
            self._report = {"window_ops": ops, "windows": held.exchanges, "ops_total": held.ops,
                            "threshold_ms": float(self.config.straggler_threshold_ms), "ranks": {
                                r: {"mean_ms": round(float(result.means[r]) * 1e3, 4),
                                    "p95_ms": round(float(np.percentile(result.lateness[r], 95)) * 1e3, 4)
                                    if ops else 0.0,
                                    "last_share": round(float(result.last[r]) / ops, 4) if ops else 0.0}
                                for r in range(self.size)}, "straggler": result.straggler}
            self._reported = held
        rep = dict(self._report)
        rep["ranks"] = {r: dict(s) for r, s in rep["ranks"].items()}
        return rep


def analyse(times: np.ndarray, threshold_ms: float) -> Analysis:
    """Every rank's lateness from every rank's times, (rank, submitted|agreed, op): the clock offsets, the
    lateness per rank and op, who was last, and the straggler (last in at least half the ops, late by more
    than ``threshold_ms`` on average; the first of equals)."""
    size = times.shape[0]
    if np.isnan(times).any():  # ops a joined rank stood in for say nothing
        times = times[:, :, ~np.isnan(times).any(axis=(0, 1))]
    ops = times.shape[2]
    if ops == 0:
        zeros = np.zeros(size)
        return Analysis(np.zeros((size, 0)), zeros.astype(np.int64), zeros, None)
    offsets = _median_rows(times[:, 1] - times[0, 1])  # each clock minus rank 0's
    submitted = times[:, 0] - offsets[:, None]
    lateness = submitted - submitted.min(axis=0)
    last = np.bincount(np.argmax(submitted, axis=0), minlength=size)
    means = lateness.mean(axis=1)
    worst = int(np.argmax(means))
    named = size > 1 and last[worst] >= 0.5 * ops and means[worst] * 1e3 > threshold_ms
    return Analysis(lateness, last, means, worst if named else None)


def _median_rows(x: np.ndarray) -> np.ndarray:
    """``np.median(x, axis=1)`` of a 2-D array without NaN, the same values, without np.median's generic
    machinery (~10x its cost on a window; its first call also imports numpy.ma, ~6 ms)."""
    n = x.shape[1]
    k = n // 2
    if n % 2:
        return np.partition(x, k, axis=1)[:, k]
    part = np.partition(x, (k - 1, k), axis=1)
    return (part[:, k - 1] + part[:, k]) / 2


def _empty(size: int, config: Config) -> dict[str, Any]:
    return {"window_ops": 0, "windows": 0, "ops_total": 0, "threshold_ms": float(config.straggler_threshold_ms),
            "ranks": {r: {"mean_ms": 0.0, "p95_ms": 0.0, "last_share": 0.0} for r in range(size)},
            "straggler": None}


__all__ = ["Analysis", "Held", "Stragglers", "analyse"]
