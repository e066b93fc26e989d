"""Scale: a 64-rank job of the core on the 2-core machine (oversubscribed) stays exact and bounded in time."""
from __future__ import annotations

import time
from pathlib import Path

from conftest import run_mpi, worker_reports


def test_64_ranks_run_hundreds_of_mixed_collectives_exactly(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = run_mpi("core_scale.py", 64, timeout=240, mpi_args=["-bind-to", "none"],
                   env={"HVDLITE_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1"}, report_dir=tmp_path)
    reports = worker_reports(tmp_path)
    assert sorted(reports) == list(range(64)), proc.stdout[-4000:] + proc.stderr[-4000:]
    for report in reports.values():  # every rank ran every collective (each result checked exactly there)
        assert (report["size"], report["collectives"]) == (64, 300) and report["cycles"] > 0, report
    assert time.monotonic() - start < 240


def test_64_ranks_negotiate_any_order_a_mismatch_a_stall_sets_and_join_exactly(tmp_path: Path) -> None:
    """The vote at 64 ranks: new names in every rank's own order are voted through (no table gathered), a
    mismatch and a stall are explained naming the rank, process sets (one without rank 0) and join run exactly."""
    start = time.monotonic()
    proc = run_mpi("negotiation_scale.py", 64, timeout=240, mpi_args=["-bind-to", "none"],
                   env={"HVDLITE_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1"}, report_dir=tmp_path)
    reports = worker_reports(tmp_path)
    assert sorted(reports) == list(range(64)), proc.stdout[-4000:] + proc.stderr[-4000:]
    for report in reports.values():
        assert report["checks"] == ["orders", "unnamed", "mismatch", "stall", "process sets", "join"], report
        # two steps of 24 names in 64 orders: votes only, the bytes gathered none
        assert report["voted_explains"] == 0 and report["full_path_bytes"] == 0 and report["vote_bytes"] > 0, report
    assert time.monotonic() - start < 240
