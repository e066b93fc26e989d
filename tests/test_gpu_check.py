"""tests/gpu_check.py, the script a GPU session runs, kept runnable: run on CPU tensors (the MPI path and the gloo
plane; any GPU hidden), every check that needs no GPU passes on every rank."""
from __future__ import annotations

import pytest

from conftest import ROOT, json_lines, run_mpi

#: The checks gpu_check.py runs without a GPU: each must say "ok" (the others say why they were skipped).
CPU_CHECKS = ("allreduce every dtype and op", "grouped and in place", "allgather uneven", "broadcast",
              "alltoall splits", "reducescatter", "process sets", "sparse", "accumulating compression",
              "optimizer equivalence", "zero optimizer equivalence", "sync batch norm")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plane", ["MPI", "GLOO"])
def test_gpu_check_passes_on_cpu_tensors(nproc: int, plane: str) -> None:
    env = {"HOROVOD_CPU_OPERATIONS": plane, "CUDA_VISIBLE_DEVICES": ""}
    proc = run_mpi(ROOT / "tests" / "gpu_check.py", nproc, env=env, timeout=120)
    reports = sorted(json_lines(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(nproc)), proc.stdout
    for report in reports:
        assert report["failures"] == [], report["failures"]
        assert {name: report["checks"].get(name) for name in CPU_CHECKS} == dict.fromkeys(CPU_CHECKS, "ok")
        skipped = {name: verdict for name, verdict in report["checks"].items() if name not in CPU_CHECKS}
        assert all(verdict.startswith("skipped: ") for verdict in skipped.values()), skipped
        assert report["plane_of_a_device_allreduce"] == plane.lower(), report
