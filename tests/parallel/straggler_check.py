"""Shared by the straggler tests (torch and Keras): the real lateness from a common clock, and the report's checks."""
from __future__ import annotations

import numpy as np

import hvdlite as hvd_core

SLEEP_S = 0.020
WINDOW = 16  # ops per straggler window


def true_lateness_ms(stamps: list[float], size: int, steps: int) -> float:
    """The slow rank's real lateness at the submitting call, from every rank's CLOCK_MONOTONIC (one clock on
    one host): the mean over the last ``steps`` steps (the report's window when a step submits one op). At
    least the 20 ms sleep; more on a loaded machine, where the woken rank waits for a core."""
    t = np.array(hvd_core.allgather_object(stamps))
    return float(np.mean((t[size - 1] - t.min(axis=0))[-steps:]) * 1e3)


def check_report(report: dict, size: int, true_ms: float) -> None:
    assert len(set(map(repr, hvd_core.allgather_object(report)))) == 1, report  # the same dict everywhere
    slow = size - 1
    assert report["windows"] >= 1 and report["straggler"] == slow, report
    assert true_ms >= SLEEP_S * 1e3 and 0.6 * true_ms < report["ranks"][slow]["mean_ms"] < 1.6 * true_ms, \
        (true_ms, report)
    assert report["ranks"][slow]["last_share"] >= 0.5, report  # last in most ops (the straggler rule)
    for r in range(slow):
        assert report["ranks"][r]["mean_ms"] < 0.4 * report["ranks"][slow]["mean_ms"], report
