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
