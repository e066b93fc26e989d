"""Straggler attribution: how late each rank submits each op, measured on each rank's own clock.

For every op of the global process set the engine agrees on, each rank records, on its own clock, when it
submitted the op and when it saw the round that agreed on it. The agreeing round ends at one moment for
every rank, so the offset between two ranks' clocks is the difference of their agreement times; its median
over the window is kept (a rank whose engine thread saw one round late, e.g. descheduled on a crowded node,
does not move it), so clocks of different hosts never need to agree. With every submission time moved onto
rank 0's clock, rank r's lateness on an op is its submission time minus the earliest one. Every
``straggler_window_ops`` agreed ops, the ranks swap these times in one non-blocking all-gather of a fixed
size, started in the cycle that completes the window (every rank counts the same agreed ops, so all reach
it in the same cycle) and finished in the next cycle, after that cycle's round (so every rank has started
it); each rank then computes the same report from the same numbers. Steady state pays no Python work per op:
a cached round's submission times come as one array (kept at the requests' cache bits when they were
counted), appended to a flat array of doubles, and the window's arithmetic is a few numpy calls; the
percentiles and the report's dict are computed only when asked for.
"""
from __future__ import annotations

import math
from array import array
from operator import attrgetter
from typing import Any, Optional

import numpy as np

from ..config import Config
from ..log import logger
from . import polling
from .timeline import Timeline

_KEY = attrgetter("key")
POLL_CAP_S = 1e-4  # the swap ends at once (every rank started it a cycle ago): a short poll


class Stragglers:
    """Per-op times of this rank, swapped once per window; the report of the last complete window."""

    def __init__(self, config: Config, rank: int, size: int) -> None:
        self.config = config
        self.rank = rank
        self.size = size
        self._submitted = array("d")  # per agreed op, this rank's submission time (NaN: no request here)
        self._agreed = array("d")     # and when its round ended here
        self._stamps: list[float] = []  # timeline time of each op (rank 0 tracing only)
        self._swap: Optional[tuple[Any, np.ndarray, list[float]]] = None  # (request, every rank's times, stamps)
        self._window: Optional[tuple[np.ndarray, np.ndarray, Optional[int], int]] = None  # lateness, last,
        # straggler and number of the last complete window
        self._report: dict[str, Any] = _empty(size, config)
        self._reported: Any = None  # the window _report was made from
        self._named: Optional[int] = None  # the rank last named in the log
        self.windows = 0

    def record(self, responses: list[Any], pending: dict[Any, Any], now: float, timeline: Timeline,
                 known: Optional[np.ndarray] = None) -> None:
        """After a round ending at ``now``: the times of each agreed op of the global set (NaN where a joined
        rank had no request), in agreed order. ``known``: the responses' submission times, when every response
        is a good one of the global set with a request here (a cached round, the steady state: the times were
        kept at each request's cache bit, engine/negotiation.py's PendingBits); else one Python pass."""
        if self.config.straggler_window_ops <= 0:
            return
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

    def swap(self, comm: Any) -> None:
        """After a cycle's ops ran: if a window is complete (the same cycle on every rank), start swapping its
        times with every rank (exactly ``straggler_window_ops`` ops each; the rest start the next window)."""
        window = self.config.straggler_window_ops
        if not 0 < window <= len(self._submitted) or self._swap is not None:
            return
        mine = np.empty((2, window), dtype=np.float64)
        mine[0] = np.frombuffer(self._submitted, dtype=np.float64, count=window)  # copies: the arrays may shrink
        mine[1] = np.frombuffer(self._agreed, dtype=np.float64, count=window)
        del self._submitted[:window], self._agreed[:window]
        stamps, self._stamps = self._stamps[:window], self._stamps[window:]
        everyone = np.empty((self.size, 2, window), dtype=np.float64)
        self._swap = (comm.Iallgather(mine, everyone), everyone, stamps)

    def settle(self, timeline: Timeline) -> None:
        """In the cycle after a swap started, after that cycle's round (every rank has started it, so it ends
        at once): finish it and adopt the window, in the same cycle on every rank."""
        if self._swap is None:
            return
        request, everyone, stamps = self._swap
        polling.wait(request, POLL_CAP_S)
        self._swap = None
        self.adopt(everyone, timeline, stamps)

    def adopt(self, times: np.ndarray, timeline: Timeline, stamps: Optional[list[float]] = None) -> None:
        """Every rank's times of the window, (rank, submitted|agreed, op), the same on every rank: the
        lateness per rank and op, who was last, the straggler and its log line (the report waits for report())."""
        if np.isnan(times).any():  # ops a joined rank stood in for say nothing
            times = times[:, :, ~np.isnan(times).any(axis=(0, 1))]
        if times.shape[2] == 0:
            return
        offsets = _median_rows(times[:, 1] - times[0, 1])  # each clock minus rank 0's
        submitted = times[:, 0] - offsets[:, None]
        lateness = submitted - submitted.min(axis=0)  # seconds after the first submission, per rank and op
        last = np.bincount(np.argmax(submitted, axis=0), minlength=self.size)
        means = lateness.mean(axis=1)
        worst = int(np.argmax(means))  # the first of equals
        self.windows += 1
        straggler: Optional[int] = None
        threshold = self.config.straggler_threshold_ms
        if self.size > 1 and last[worst] >= 0.5 * lateness.shape[1] and means[worst] * 1e3 > threshold:
            straggler = worst
            if self.rank == 0 and self._named != worst:
                logger.warning("rank %d is the straggler: it submitted last in %.0f%% of the last %d ops, "
                               "%.1f ms after the first rank on average (p95 %.1f ms; straggler_threshold_ms=%g). "
                               "hvd.straggler_report() has every rank's figures.", worst,
                               last[worst] * 100 / lateness.shape[1], lateness.shape[1], means[worst] * 1e3,
                               np.percentile(lateness[worst], 95) * 1e3, threshold)
        self._named = straggler
        # one assignment: report() on a user thread sees a whole window
        self._window = (lateness, last, straggler, self.windows)
        if timeline.enabled and stamps is not None and len(stamps) == lateness.shape[1]:  # no joined rank's gaps
            for i, ts in enumerate(stamps):
                timeline.counter("LATENESS_MS", ts, {f"rank {r}": round(float(lateness[r, i]) * 1e3, 3)
                                                     for r in range(self.size)})

    def report(self) -> dict[str, Any]:
        """The last complete window's report: a fresh copy, identical on every rank (computed on first ask)."""
        window = self._window
        if window is not None and self._reported is not window:
            lateness, last, straggler, windows = window
            self._report = {"window_ops": int(lateness.shape[1]), "windows": windows,
                            "threshold_ms": float(self.config.straggler_threshold_ms), "ranks": {
                                r: {"mean_ms": round(float(lateness[r].mean()) * 1e3, 4),
                                    "p95_ms": round(float(np.percentile(lateness[r], 95)) * 1e3, 4),
                                    "last_share": round(float(last[r]) / lateness.shape[1], 4)}
                                for r in range(self.size)}, "straggler": straggler}
            self._reported = window
        rep = dict(self._report)
        rep["ranks"] = {r: dict(s) for r, s in rep["ranks"].items()}
        return rep


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
    return {"window_ops": 0, "windows": 0, "threshold_ms": float(config.straggler_threshold_ms),
            "ranks": {r: {"mean_ms": 0.0, "p95_ms": 0.0, "last_share": 0.0} for r in range(size)},
            "straggler": None}


__all__ = ["Stragglers"]
