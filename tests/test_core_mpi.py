"""Multi-process tests of the core under mpiexec -n 2 and -n 3."""
from __future__ import annotations

import pytest

from conftest import run_mpi


def assert_all_ok(proc, n: int) -> None:
    for rank in range(n):
        assert f"OK rank {rank}" in proc.stdout, proc.stdout + proc.stderr


def test_every_collective_dtype_and_op(nproc: int) -> None:
    assert_all_ok(run_mpi("core_collectives.py", nproc, timeout=180), nproc)


@pytest.mark.parametrize("capacity", ["1024", "7", "0"], ids=["cache", "evicting-cache", "no-cache"])
def test_opposite_submission_orders(nproc: int, capacity: str) -> None:
    proc = run_mpi("core_order.py", nproc, env={"HVDLITE_CACHE_CAPACITY": capacity})
    assert_all_ok(proc, nproc)


def test_mismatch_errors_then_engine_goes_on(nproc: int) -> None:
    assert_all_ok(run_mpi("core_errors.py", nproc), nproc)


def test_join_with_uneven_data(nproc: int) -> None:
    assert_all_ok(run_mpi("core_join.py", nproc), nproc)


def test_stall_warning_and_stall_shutdown(nproc: int) -> None:
    proc = run_mpi("core_stall.py", nproc)
    assert_all_ok(proc, nproc)
    warning = [line for line in proc.stderr.splitlines() if "late.tensor" in line]
    assert warning, proc.stderr
    assert f"missing ranks [{nproc - 1}]" in warning[0], warning
    assert "[hvdlite rank 0] WARNING" in proc.stderr


def test_fusion_uses_fewer_mpi_calls_and_timeline(nproc: int, tmp_path) -> None:
    fused = run_mpi("core_fusion.py", nproc, args=[str(tmp_path / "fused.json"), str(4 << 20)])
    assert_all_ok(fused, nproc)
    unfused = run_mpi("core_fusion.py", nproc, args=[str(tmp_path / "unfused.json"), "0"])
    assert_all_ok(unfused, nproc)


def test_raising_rank_ends_the_job_with_its_traceback_first(nproc: int) -> None:
    import time
    start = time.monotonic()
    proc = run_mpi("core_failures.py", nproc, args=["raise"], check=False, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a rank raised"
    first = proc.stderr.strip().splitlines()
    assert first[0].startswith("[hvdlite rank 1] uncaught exception"), proc.stderr
    assert "ValueError: the real error on rank 1: bad batch 17" in proc.stderr
    assert "shut down" not in proc.stderr and "ShutdownError" not in proc.stderr, proc.stderr


def test_raising_thread_ends_the_job_with_its_traceback_first(nproc: int) -> None:
    import time
    start = time.monotonic()
    proc = run_mpi("core_failures.py", nproc, args=["thread_raise"], check=False, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a thread raised"
    first = proc.stderr.strip().splitlines()
    assert first[0].startswith("[hvdlite rank 1] uncaught exception in thread loader"), proc.stderr
    assert "ValueError: the real error in rank 1's loader thread: bad batch 17" in proc.stderr
    assert "shut down" not in proc.stderr and "ShutdownError" not in proc.stderr, proc.stderr


def test_dying_rank_ends_the_job(nproc: int) -> None:
    proc = run_mpi("core_failures.py", nproc, args=["die"], check=False, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_rank_exiting_early_fails_peers_with_the_cause(nproc: int) -> None:
    proc = run_mpi("core_failures.py", nproc, args=["early_exit"], timeout=60)
    for rank in (0,) + tuple(range(2, nproc)):
        assert f"OK rank {rank}" in proc.stdout, proc.stdout + proc.stderr


def test_init_with_communicators_and_process_sets(nproc: int) -> None:
    assert_all_ok(run_mpi("core_init.py", nproc), nproc)
