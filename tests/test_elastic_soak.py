"""The short soak (benchmarks/elastic_soak.py): ten failures in one elastic torch job under Open MPI 5 (in-process
recovery), random ranks (rank 0 among them) at random times, regrowth to 4 ranks after each through discovery."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from cluster.fixtures import ROOT, base_env, run

SOAK = ROOT / "benchmarks" / "elastic_soak.py"
FAILURES = 10
COMMIT_EVERY = 4


@pytest.mark.timeout(1000)
def test_ten_failures_in_one_job_are_all_survived(ompi_python: str, tmp_path: Path) -> None:
    """-np 4 --min-np 2 --max-np 4, a discovery script listing 4 slots, a rank killed (SIGKILL) every 0.3-1.5 s
    (several in one job before it grows back), the training ending at the first epoch's end after the last: every
    failure is named by the driver and survived (in-process, or through a restart below --min-np), the job
    finishes (exit 0), each epoch processed every sample exactly once, the final weights are bitwise equal on
    every rank, no rollback lost more than the uncommitted steps, and the model learned."""
    log = tmp_path / "soak.log"
    proc = run([sys.executable, str(SOAK), "--ompi-python", ompi_python, "--failures", str(FAILURES), "--interval",
                "0.3", "1.5", "--stop-fraction", "0", "--epochs", "1000", "--until-failures", "--samples", "512",
                "--sleep", "0.01", "--commit-every", str(COMMIT_EVERY), "--seed", "7", "--log", str(log)], timeout=900,
               env=base_env())
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + out
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = {k: v for k, v in result.items() if k != "per_failure"}
    assert result["failures"] == FAILURES and result["rank0_failures"] >= 1, (summary, out)
    assert result["exit_code"] == 0 and result["finished"], (summary, out)
    assert result["named_by_driver"] == FAILURES and result["survived"] == FAILURES, (summary, out)
    assert result["epochs_exact"] and result["weights_identical"] and result["final_ranks"] >= 2, (summary, out)
    assert result["steps_lost"]["max"] <= COMMIT_EVERY, (summary, out)
    assert all(f["recovery_s"] is not None for f in result["per_failure"]), (result["per_failure"], out)
    for failure in result["per_failure"]:  # named once: the regrowth after a recovered loss does not blame it again
        assert len(re.findall(rf"\(pid {failure['pid']}\) failed", out)) == 1, (failure, out)
    assert result["accuracy"] >= 0.6, (summary, out)  # (4 classes: chance is 0.25)
    # (a survivor may segfault inside Open MPI's MPIX_Comm_shrink when another rank dies meanwhile: a lost rank
    # like any other, docs/elastic.md "A second rank lost during the shrink"; the asserts above say it cost nothing)
    assert "no rank used hvd.elastic.run" not in out, out
