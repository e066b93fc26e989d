"""Straggler attribution: how late each rank submits each op, measured on each rank's own clock.

A round that agrees ops ends at one moment on every rank, so the median difference of a rank's agreement times and
rank 0's is its clock's offset (hosts' clocks never need to agree). When and how the ranks exchange their times, in
bytes that do not grow with the job: docs/ARCHITECTURE.md. An op submitted before the ranks first met is start-up
(NaN, as for a joined rank).
"""
from __future__ import annotations

import math
import threading
import time
from array import array
from operator import attrgetter
from typing import Any, NamedTuple, Optional

import numpy as np

from ..config import Config
from ..log import logger
from . import polling
from .chunks import start_allreduce
from .timeline import Timeline

_KEY = attrgetter("key")
STEADY_AFTER_S = 0.5  # the log line judges only ops agreed this long after the ranks first met (lazy set-up aside)
STEADY_OPS = 10  # ... and only once it has this many of them
#: A rank is named when two exchanges in a row find it (one that alternates with another is noise); another rank only
#: this many ops (or a window) later: noise may name a rank before the real one.
RENAME_OPS = 100
TOP_RANKS = 8  # the report's ranks: the this-many latest on average (every rank of a smaller job)
_NONE = (-math.inf, 0.0, 0.0, math.inf)  # no summary; a summary: (mean lateness s, p95 s, last share, rank)


class Held(NamedTuple):
    """This rank's side of the last <= straggler_window_ops ops exchanged."""
    agreed0: np.ndarray  # rank 0's agreement times (its clock)
    agreed: np.ndarray   # this rank's (its clock)
    late: np.ndarray     # this rank's lateness in seconds (NaN: no request here)
    last: np.ndarray     # whether this rank submitted last
    valid: np.ndarray    # whether every rank had a request (a joined rank's stand-ins say nothing)


class Stragglers:
    """Per-op times of this rank, reduced with every rank's; the report of the last ops exchanged."""

    def __init__(self, config: Config, rank: int, size: int, mpi_ops: Any) -> None:
        self.config = config
        self.rank = rank
        self.size = size
        self._mpi = mpi_ops
        self._submitted = array("d")  # per agreed op, this rank's submission time (NaN: no request here)
        self._agreed = array("d")     # and when its round ended here
        self._stamps: list[float] = []  # timeline time of each op (rank 0 tracing only)
        self._held: Optional[Held] = None
        self._fresh: Optional[tuple[np.ndarray, int, list[float], np.ndarray, list[int]]] = None  # settle()'s
        self._report = _report(np.array([(0.0, 0.0, 0.0, r) for r in range(min(size, TOP_RANKS))]), 0, 0, 0,
                               config.straggler_threshold_ms, size)
        self._named: Optional[int] = None  # the rank last named in the log
        self._candidate: Optional[float] = None  # the last steady exchange's straggler: named only when it is again
        self._named_at = -1  # the ops exchanged when it was named (-1: never)
        self._due = False  # rank 0 asked for an exchange: the next cycle with agreed ops makes one
        self.quiet = threading.Event()  # no exchange in progress: report() waits for it
        self.quiet.set()
        self._met = math.inf  # when this rank's first round agreed ops (the ranks first met), on its clock
        self.windows = self.ops = 0  # exchanges so far, agreed ops exchanged so far
        # rank 0's clock: when it raises FLAG_EXCHANGE (inf: never; the loop compares it once per cycle)
        ticks = rank == 0 and config.straggler_window_ops > 0 and config.straggler_window_seconds > 0
        self.tick_at = time.monotonic() + config.straggler_window_seconds if ticks else math.inf

    def record(self, responses: list[Any], pending: dict[Any, Any], now: float, timeline: Timeline,
               known: Optional[np.ndarray] = None) -> None:
        """Before a round's ops complete: each agreed global-set op's times, in order (NaN: a joined rank's; ``known``:
        from cache.PendingBits, a cached round of that set). A full window or rank 0's tick: swap() after the ops."""
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
        if len(submitted) >= self.config.straggler_window_ops or (self._due and submitted):
            self.quiet.clear()  # until swap() ends: report() waits for it

    def tick(self) -> None:
        """Every rank, in the cycle whose round carried rank 0's FLAG_EXCHANGE: exchange at the next swap() with ops."""
        self._due = True
        self.tick_at = math.inf

    def swap(self, comm: Any) -> None:
        """After the ops of a cycle whose record() found it due: reduce their times (a full window; after a tick, every
        op counted), keep the last window. After the ops: bursts took 0.89-0.99x the time (benchmarks/HISTORY.md)."""
        if self.quiet.is_set():
            return
        window, mpi = self.config.straggler_window_ops, self._mpi
        count = min(len(self._submitted), window)
        submitted = np.frombuffer(self._submitted, dtype=np.float64, count=count).copy()  # the arrays shrink
        agreed = np.frombuffer(self._agreed, dtype=np.float64, count=count).copy()
        submitted[submitted < self._met] = math.nan  # submitted before the ranks first met: start-up, not lateness
        del self._submitted[:count], self._agreed[:count]
        stamps, self._stamps = self._stamps[:count], self._stamps[count:]
        zero = np.concatenate((agreed, [self._met, len(stamps) == count]))  # rank 0's; and whether it traces
        polling.wait(comm.Ibcast(zero, root=0))
        held = self._held
        offsets = agreed - zero[:count] if held is None else \
            np.concatenate((held.agreed - held.agreed0, agreed - zero[:count]))
        mine = submitted - _quantile(offsets, 0.5)  # on rank 0's clock
        lacking = np.isnan(mine)
        spans = np.stack((np.where(lacking, math.inf, mine), np.where(lacking, math.inf, -mine), lacking * -1.0))
        polling.wait(start_allreduce(comm, mpi.tree, spans.copy(), spans, None, mpi.MPI.MIN, polling.wait))
        valid = spans[2] == 0  # no rank lacked the op
        late, last = mine - spans[0], valid & (mine == -spans[1])
        held = Held(zero[:count], agreed, late, last, valid)
        self.windows, self.ops, self._due = self.windows + 1, self.ops + count, False
        if self._held is not None:  # the last straggler_window_ops ops
            held = Held(*(np.concatenate(pair)[-window:] for pair in zip(self._held, held)))
        self._held = held
        steady = held.valid & (held.agreed0 >= zero[count] + STEADY_AFTER_S)
        top = self._reduce(comm, _summary(held, held.valid, self.rank), _summary(held, steady, self.rank))
        self._report = _report(top[:TOP_RANKS], int(held.valid.sum()), self.windows, self.ops,
                               self.config.straggler_threshold_ms, self.size)
        if self.rank == 0 and self.config.straggler_window_seconds > 0:
            self.tick_at = time.monotonic() + self.config.straggler_window_seconds
        rows, ranks = np.zeros((TOP_RANKS, count)), top[:TOP_RANKS, 3]
        if zero[count + 1]:  # rank 0 traces: the report's ranks' lateness on each new op, for its timeline
            rows[ranks == self.rank] = np.where(valid, late, 0.0)
            polling.wait(start_allreduce(comm, mpi.tree, rows.copy(), rows, None, mpi.MPI.SUM, polling.wait))
        if self.rank == 0:
            self._fresh = (top[TOP_RANKS], int(steady.sum()), stamps if valid.all() else [], rows,
                           [int(r) for r in ranks[np.isfinite(ranks)]])
        self.quiet.set()

    def _reduce(self, comm: Any, mine: tuple[float, ...], steady: tuple[float, ...]) -> np.ndarray:
        """Every rank's summaries (all held ops; the steady ones) as one all-reduce of a fixed-size record (_merge)."""
        record = np.array([mine, *[_NONE] * (TOP_RANKS - 1), steady])
        op, dtype = self._mpi.record_op(_merge, record.size)
        out = np.empty_like(record)
        polling.wait(start_allreduce(comm, self._mpi.tree, [record, dtype], out, dtype, op, polling.wait))
        return out

    def settle(self, timeline: Timeline) -> None:
        """Rank 0, after an exchange's ops ran: name a new straggler in one log line; lateness on the timeline."""
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return
        (mean, p95, share, worst), ops, stamps, rows, ranks = fresh
        named = worst if share >= 0.5 and mean * 1e3 > self.config.straggler_threshold_ms and self.size > 1 else None
        again, self._candidate = named == self._candidate, named if ops >= STEADY_OPS else self._candidate
        if named is None and ops >= STEADY_OPS:
            self._named = None
        elif named is not None and ops >= STEADY_OPS and again and named != self._named and (
                self._named_at < 0 or self.ops - self._named_at >= min(self.config.straggler_window_ops, RENAME_OPS)):
            logger.warning("rank %d is the straggler: it submitted last in %.0f%% of the last %d ops, "
                           "%.1f ms after the first rank on average (p95 %.1f ms; straggler_threshold_ms=%g). "
                           "hvd.straggler_report() has the latest ranks' figures.", named, share * 100, ops,
                           mean * 1e3, p95 * 1e3, self.config.straggler_threshold_ms)
            self._named, self._named_at = int(named), self.ops
        for i, ts in enumerate(stamps if timeline.enabled else []):
            timeline.counter("LATENESS_MS", ts, {f"rank {r}": round(float(rows[j, i]) * 1e3, 3)
                                                 for j, r in enumerate(ranks)})

    def report(self) -> dict[str, Any]:
        """The last ``straggler_window_ops`` ops exchanged (or fewer), a fresh copy: every rank's alike after an op."""
        self.quiet.wait()
        return {**self._report, "ranks": {r: dict(s) for r, s in self._report["ranks"].items()}}


def _summary(held: Held, ops: np.ndarray, rank: int) -> tuple[float, ...]:
    """This rank's (mean lateness s, p95 s, share of ``ops`` it was last in, its rank)."""
    late = held.late[ops]
    if not late.size:
        return (0.0, 0.0, 0.0, float(rank))
    return (float(late.mean()), _quantile(late, 0.95), float(held.last[ops].mean()), float(rank))


def _merge(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    """The summaries' reduction: the TOP_RANKS latest of both lists (the lower rank first among equals), then
    the later of both steady summaries."""
    a = np.frombuffer(inbuf, dtype=np.float64).reshape(-1, TOP_RANKS + 1, 4)
    b = np.frombuffer(inoutbuf, dtype=np.float64).reshape(-1, TOP_RANKS + 1, 4)
    for x, y in zip(a, b):
        rows = np.concatenate((x[:TOP_RANKS], y[:TOP_RANKS]))
        y[:TOP_RANKS] = rows[np.lexsort((rows[:, 3], -rows[:, 0]))][:TOP_RANKS]
        if (x[TOP_RANKS, 0], -x[TOP_RANKS, 3]) > (y[TOP_RANKS, 0], -y[TOP_RANKS, 3]):
            y[TOP_RANKS] = x[TOP_RANKS]


def _report(top: np.ndarray, ops: int, exchanges: int, total: int, threshold_ms: float, size: int) -> dict[str, Any]:
    """The report from the latest ranks' summaries (latest first): the straggler is the latest, if it was last
    in at least half the ops and later than ``threshold_ms`` on average."""
    top = top[np.isfinite(top[:, 0])]
    mean, _, share, worst = top[0]
    named = size > 1 and ops > 0 and share >= 0.5 and mean * 1e3 > threshold_ms
    return {"window_ops": ops, "windows": exchanges, "ops_total": total, "threshold_ms": float(threshold_ms),
            "ranks": {int(r): {"mean_ms": round(m * 1e3, 4), "p95_ms": round(p * 1e3, 4), "last_share": round(s, 4)}
                      for m, p, s, r in sorted(top.tolist(), key=lambda row: row[3])},
            "straggler": int(worst) if named else None}


def _quantile(x: np.ndarray, q: float) -> float:
    """``np.percentile(x, 100 q)`` (its linear method) of a 1-D array without NaN, without its generic machinery
    (several times its cost on a window; its first call also imports numpy.ma, ~6 ms on the engine thread)."""
    pos = q * (x.size - 1)
    lo, hi = int(pos), min(int(pos) + 1, x.size - 1)
    part = np.partition(x, (lo, hi))
    return float(part[lo] + (part[hi] - part[lo]) * (pos - lo))
