"""Shared by the straggler tests (torch and Keras): the real lateness from a common clock, and the report's checks."""
from __future__ import annotations

import numpy as np

import hvdlite as hvd_core

SLEEP_S = 0.020
WINDOW = 16  # ops per straggler window


def true_lateness_ms(stamps: list[float], size: int, steps: int) -> list[float]:
    """Each rank's real lateness at the submitting call, from every rank's CLOCK_MONOTONIC (one clock on one
    host): the mean over the last ``steps`` steps (the report's window when a step submits one op). The slow
    rank's is about the 20 ms sleep; more on a loaded machine, where the woken rank waits for a core (and a
    loaded machine makes the others late now and then too)."""
    t = np.array(hvd_core.allgather_object(stamps))
    return [float(np.mean((t[r] - t.min(axis=0))[-steps:]) * 1e3) for r in range(size)]


def check_report(report: dict, size: int, true_ms: list[float]) -> None:
    """The report is the same everywhere, names the slow (last) rank, and gives every rank's lateness to
    within 40% of the slow rank's real lateness."""
    assert len(set(map(repr, hvd_core.allgather_object(report)))) == 1, report  # the same dict everywhere
    slow = size - 1
    assert report["windows"] >= 1 and report["straggler"] == slow, report
    assert true_ms[slow] >= 0.5 * SLEEP_S * 1e3, true_ms  # the set-up: the sleeping rank is really late
    assert report["ranks"][slow]["last_share"] >= 0.5, report  # last in most ops (the straggler rule)
    for r in range(size):
        assert abs(report["ranks"][r]["mean_ms"] - true_ms[r]) < 0.4 * true_ms[slow], (r, true_ms, report)
