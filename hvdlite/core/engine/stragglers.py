"""Straggler attribution: how late each rank submits each op, measured on each rank's own clock.

For every op of the global process set the engine agrees on, each rank records, on its own clock, when it
submitted the op and when it saw the round that agreed on it. The agreeing round ends at one moment for
every rank, so the offset between two ranks' clocks is the difference of their agreement times; its median
over the window is kept (a rank whose engine thread saw one round late, e.g. descheduled on a crowded node,
does not move it), so clocks of different hosts never need to agree. With every submission time moved onto
rank 0's clock, rank r's lateness on an op is its submission time minus the earliest one. Every
``straggler_window_ops`` agreed ops, the ranks swap these times in one full negotiation round (every rank
counts the same agreed ops, so all reach the window in the same cycle) and each computes the same report
from the same numbers.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..config import Config
from ..log import logger
from .timeline import Timeline


class Stragglers:
    """Per-op times of this rank, swapped once per window; the report of the last complete window."""

    def __init__(self, config: Config, rank: int, size: int) -> None:
        self.config = config
        self.rank = rank
        self.size = size
        self._submitted: list[float] = []  # per agreed op, this rank's submission time (NaN: no request here)
        self._agreed: list[float] = []     # and when its round ended here
        self._stamps: list[float] = []  # timeline time of each op (rank 0 tracing only)
        self._sent_stamps: list[float] = []  # those of the window just sent
        self._report: dict[str, Any] = _empty(size, config)
        self._named: Optional[int] = None  # the rank last named in the log
        self.windows = 0

    def record(self, responses: list[Any], pending: dict[Any, Any], now: float, timeline: Timeline) -> None:
        """After a round ending at ``now``: the times of each agreed op of the global set (NaN where a joined
        rank had no request), in agreed order."""
        if self.config.straggler_window_ops <= 0:
            return
        submitted = self._submitted
        for resp in responses:
            if resp.error is None and resp.key[0] == 0:
                req = pending.get(resp.key)
                submitted.append(req.submitted if req is not None else math.nan)
        self._agreed += [now] * (len(submitted) - len(self._agreed))
        if timeline.enabled:
            self._stamps += [timeline.now()] * (len(submitted) - len(self._stamps))

    def wants_round(self) -> bool:
        """A window is complete (the same cycle on every rank): swap the times in the next round."""
        window = self.config.straggler_window_ops
        return 0 < window <= len(self._submitted)

    def outgoing(self) -> Optional[np.ndarray]:
        """This rank's (submitted, agreed) times for its message of a full round, when a window is complete."""
        if not self.wants_round():
            return None
        out = np.array([self._submitted, self._agreed], dtype=np.float64)
        self._submitted.clear()
        self._agreed.clear()
        self._sent_stamps, self._stamps = self._stamps, []
        return out

    def adopt(self, all_times: list[Optional[np.ndarray]], timeline: Timeline) -> None:
        """Every rank's times of the window (the same on every rank): compute the report, log a straggler."""
        if any(t is None for t in all_times):
            return
        ops = min(t.shape[1] for t in all_times)  # type: ignore[union-attr]
        times = np.stack([t[:, :ops] for t in all_times])  # type: ignore[index]  # (rank, submitted|agreed, op)
        times = times[:, :, ~np.isnan(times).any(axis=(0, 1))]  # ops a joined rank stood in for say nothing
        if times.shape[2] == 0:
            return
        offsets = np.median(times[:, 1] - times[0, 1], axis=1)  # each clock minus rank 0's
        submitted = times[:, 0] - offsets[:, None]
        lateness = submitted - submitted.min(axis=0)  # seconds after the first submission, per rank and op
        last = np.bincount(np.argmax(submitted, axis=0), minlength=self.size)
        self.windows += 1
        ranks: dict[int, dict[str, float]] = {
            r: {"mean_ms": round(float(lateness[r].mean()) * 1e3, 4),
                "p95_ms": round(float(np.percentile(lateness[r], 95)) * 1e3, 4),
                "last_share": round(float(last[r]) / lateness.shape[1], 4)} for r in range(self.size)}
        worst = max(range(self.size), key=lambda r: (ranks[r]["mean_ms"], -r))
        stats = ranks[worst]
        straggler: Optional[int] = None
        if self.size > 1 and stats["last_share"] >= 0.5 and stats["mean_ms"] > self.config.straggler_threshold_ms:
            straggler = worst
            if self.rank == 0 and self._named != worst:
                logger.warning("rank %d is the straggler: it submitted last in %.0f%% of the last %d ops, "
                               "%.1f ms after the first rank on average (p95 %.1f ms; straggler_threshold_ms=%g). "
                               "hvd.straggler_report() has every rank's figures.", worst,
                               stats["last_share"] * 100, lateness.shape[1], stats["mean_ms"], stats["p95_ms"],
                               self.config.straggler_threshold_ms)
        self._named = straggler
        self._report = {"window_ops": int(lateness.shape[1]), "windows": self.windows,
                        "threshold_ms": float(self.config.straggler_threshold_ms), "ranks": ranks,
                        "straggler": straggler}
        stamps, self._sent_stamps = self._sent_stamps, []
        if timeline.enabled and len(stamps) == ops and lateness.shape[1] == ops:  # no joined rank's gaps
            for i, ts in enumerate(stamps):
                timeline.counter("LATENESS_MS", ts, {f"rank {r}": round(float(lateness[r, i]) * 1e3, 3)
                                                     for r in range(self.size)})

    def report(self) -> dict[str, Any]:
        """The last complete window's report: a fresh copy, identical on every rank."""
        rep = dict(self._report)
        rep["ranks"] = {r: dict(s) for r, s in rep["ranks"].items()}
        return rep


def _empty(size: int, config: Config) -> dict[str, Any]:
    return {"window_ops": 0, "windows": 0, "threshold_ms": float(config.straggler_threshold_ms),
            "ranks": {r: {"mean_ms": 0.0, "p95_ms": 0.0, "last_share": 0.0} for r in range(size)},
            "straggler": None}


__all__ = ["Stragglers"]
