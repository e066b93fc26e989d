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
from typing import Any, Iterator, NamedTuple, Optional

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
        self._report = _report(np.array([(0.0, 0.0, 0.0, r) for r in range(min(size, TOP_RANKS))]), 0, 0, 0,
                               config.straggler_threshold_ms, size)
        self._named: Optional[int] = None  # the rank last named in the log
        self._candidate: Optional[float] = None  # the last steady exchange's straggler: named only when it is again
        self._named_at = -1  # the ops exchanged when it was named (-1: never)
        self._due = False  # rank 0 asked for an exchange: the next cycle with agreed ops makes one
        self._steps: Iterator[Any] = iter(())  # the exchange in progress: each step starts a collective
        self._request: Any = None  # the one the next step waits for (None: no exchange in progress)
        self.quiet = threading.Event()  # no exchange in progress: report() waits for it
        self.quiet.set()
        self._met = math.inf  # when this rank's first round agreed ops (the ranks first met), on its clock
        self.windows = self.ops = 0  # exchanges so far, agreed ops up to the last exchange's
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
        self._agreed += array("d", (now,)) * (len(submitted) - len(self._agreed))  # (each new op's)
        if timeline.enabled:
            self._stamps += [timeline.now()] * (len(submitted) - len(self._stamps))
        if len(submitted) >= self.config.straggler_window_ops or (self._due and submitted):
            self.quiet.clear()  # until its exchange ends: report() waits for it

    def tick(self) -> None:
        """Every rank, in the cycle whose round carried rank 0's FLAG_EXCHANGE: exchange at the next swap() with ops."""
        self._due = True
        self.tick_at = math.inf

    def swap(self, comm: Any, timeline: Timeline) -> None:
        """After each cycle's ops: the exchange in progress takes its next step, in the same cycle on every rank, so
        each of its collectives has had a cycle to complete and no wait holds the engine; when none is in progress, a
        due one (a full window; after a tick, every op counted) starts. Bursts: benchmarks/HISTORY.md."""
        if self.quiet.is_set():
            return
        if self._request is not None:
            polling.wait(self._request)
            self._request = next(self._steps, None)
        if self._request is None and (len(self._submitted) >= self.config.straggler_window_ops or self._due and
                                      self._submitted):
            self._steps = self._exchange(comm, timeline)
            self._request = next(self._steps)
        elif self._request is None:
            self.quiet.set()

    def _exchange(self, comm: Any, timeline: Timeline) -> Iterator[Any]:
        """Reduce the counted ops' times (the latest window; a backlog's older ops skipped); yields each collective."""
        window, mpi = self.config.straggler_window_ops, self._mpi
        skip = max(0, len(self._submitted) - window)
        count, self._due = len(self._submitted) - skip, False
        submitted = np.frombuffer(self._submitted, dtype=np.float64)[skip:].copy()  # the arrays are emptied
        agreed = np.frombuffer(self._agreed, dtype=np.float64)[skip:].copy()
        submitted[submitted < self._met] = math.nan  # submitted before the ranks first met: start-up, not lateness
        del self._submitted[:], self._agreed[:]
        stamps, self._stamps = self._stamps[skip:], []
        zero = np.concatenate((agreed, [self._met, len(stamps) == count]))  # rank 0's; and whether it traces
        yield comm.Ibcast(zero, root=0)
        held = self._held
        offsets = agreed - zero[:count] if held is None else \
            np.concatenate((held.agreed - held.agreed0, agreed - zero[:count]))
        mine = submitted - _quantile(offsets, 0.5)  # on rank 0's clock
        lacking = np.isnan(mine)
        spans = np.stack((np.where(lacking, math.inf, mine), np.where(lacking, math.inf, -mine), lacking * -1.0))
        yield start_allreduce(comm, mpi.tree, spans.copy(), spans, None, mpi.MPI.MIN, polling.wait)
        valid = spans[2] == 0  # no rank lacked the op
        late, last = mine - spans[0], valid & (mine == -spans[1])
        held = Held(zero[:count], agreed, late, last, valid)
        self.windows, self.ops = self.windows + 1, self.ops + skip + count  # (ops: the skipped too)
        if self._held is not None:  # the last straggler_window_ops ops
            held = Held(*(np.concatenate(pair)[-window:] for pair in zip(self._held, held)))
        self._held = held
        steady = held.valid & (held.agreed0 >= zero[count] + STEADY_AFTER_S)
        # every rank's summaries (all held ops; the steady ones) as one all-reduce of a fixed-size record (_merge)
        send = np.array([_summary(held, held.valid, self.rank), *[_NONE] * (TOP_RANKS - 1),
                         _summary(held, steady, self.rank)])
        op, dtype = mpi.record_op(_merge, send.size)
        top = np.empty_like(send)
        yield start_allreduce(comm, mpi.tree, [send, dtype], top, dtype, op, polling.wait)
        self._report = _report(top[:TOP_RANKS], int(held.valid.sum()), self.windows, self.ops,
                               self.config.straggler_threshold_ms, self.size)
        if self.rank == 0 and self.config.straggler_window_seconds > 0:
            self.tick_at = time.monotonic() + self.config.straggler_window_seconds
        rows, ranks = np.zeros((TOP_RANKS, count)), top[:TOP_RANKS, 3]
        if zero[count + 1]:  # rank 0 traces: the report's ranks' lateness on each new op, for its timeline
            rows[ranks == self.rank] = np.where(valid, late, 0.0)
            yield start_allreduce(comm, mpi.tree, rows.copy(), rows, None, mpi.MPI.SUM, polling.wait)
        if self.rank == 0:
            self.name(int(steady.sum()), *top[TOP_RANKS].tolist())
        for i, ts in enumerate(stamps if self.rank == 0 and valid.all() and timeline.enabled else []):
            timeline.counter("LATENESS_MS", ts, {f"rank {int(r)}": round(float(rows[j, i]) * 1e3, 3)
                                                 for j, r in enumerate(ranks[np.isfinite(ranks)])})

    def name(self, ops: int, mean: float, p95: float, share: float, worst: float) -> None:
        """Rank 0, at an exchange's end: name a new straggler in one log line (its steady ops' latest summary)."""
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
