"""Scale: a 64-rank job of the core on the 2-core machine (oversubscribed) stays exact and bounded in time."""
from __future__ import annotations

import time

from conftest import run_mpi


def test_64_ranks_run_hundreds_of_mixed_collectives_exactly() -> None:
    start = time.monotonic()
    proc = run_mpi("core_scale.py", 64, timeout=240, mpi_args=["-bind-to", "none"],
                   env={"HVDLITE_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1"})
    for rank in range(64):
        assert f"OK rank {rank} " in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert time.monotonic() - start < 240
