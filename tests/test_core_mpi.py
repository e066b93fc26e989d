"""Failure modes of the core that need a whole MPI job (mpiexec -n 2 and -n 3): a rank that raises, dies
or exits early must end or fail the job promptly. The rest of the core's multi-process tests run inside
the ranks: tests/parallel/test_core_*.py."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import run_mpi, worker_reports


@pytest.mark.parametrize("mode,where,error", [
    ("raise", "", "ValueError: the real error on rank 1: bad batch 17"),
    ("thread_raise", " in thread loader", "ValueError: the real error in rank 1's loader thread: bad batch 17"),
], ids=["main-thread", "other-thread"])
def test_raising_rank_ends_the_job_with_its_traceback_first(nproc: int, mode: str, where: str, error: str) -> None:
    start = time.monotonic()
    proc = run_mpi("core_failures.py", nproc, args=[mode], check=False, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a rank raised"
    first = proc.stderr.strip().splitlines()
    assert first[0].startswith(f"[hvdlite rank 1] uncaught exception{where}; aborting"), proc.stderr
    assert error in proc.stderr
    assert "shut down" not in proc.stderr and "ShutdownError" not in proc.stderr, proc.stderr


def test_dying_rank_ends_the_job(nproc: int) -> None:
    proc = run_mpi("core_failures.py", nproc, args=["die"], check=False, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_rank_exiting_early_fails_peers_with_the_cause(nproc: int, tmp_path: Path) -> None:
    proc = run_mpi("core_failures.py", nproc, args=["early_exit"], timeout=60, report_dir=tmp_path)
    reports = worker_reports(tmp_path)
    assert sorted(reports) == [0] + list(range(2, nproc)), proc.stdout + proc.stderr  # rank 1 left first
    for report in reports.values():
        # the peers' pending op fails with the cause, and a later call fails too
        assert "rank(s) 1 called hvd.shutdown() or exited" in report["error"], report
        assert "call hvd.join() on every rank" in report["error"], report  # the fix for uneven batches
        assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=S" in report["error"], report
        assert report["later_error"] == "ShutdownError", report
