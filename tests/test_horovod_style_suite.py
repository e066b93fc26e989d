"""Runs tests/workers/horovod_style_suite.py WHOLE as one job (as Horovod's CI runs its suites) at -n 2 and
-n 3, and checks every test's outcome on every rank against the outcome it declares, from the per-rank JSON
reports: the failing tests fail with the declared exception, and every other test passes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_mpi

SUITE = "horovod_style_suite.py"
ENV = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2", "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.2",
       "SUITE_EPISODE_SECONDS": "5"}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.timeout(420)
def test_horovod_style_suite_run_whole(n: int, tmp_path: Path) -> None:
    proc = run_mpi(SUITE, n, args=["--report", str(tmp_path)], timeout=360, env=ENV, check=False)
    problems = []
    reports = {}
    for r in range(n):
        path = tmp_path / f"rank{r}.json"
        if not path.exists():
            problems.append(f"rank {r} wrote no report")
            continue
        reports[r] = json.loads(path.read_text())
    for r, report in reports.items():
        tests = report["tests"]
        assert len(tests) >= 30 and report["order"] == sorted(report["order"]), report["order"]
        failing = [name for name, t in tests.items() if t["expected"] != "pass"]
        assert len(failing) >= 8 and report["order"].index(failing[0]) < 3, failing
        for name in report["order"]:
            t = tests[name]
            if t["outcome"] != t["expected"]:
                problems.append(f"rank {r}: {name}: expected {t['expected']}, got {t['outcome']}: "
                                f"{t.get('traceback', '')}")
    assert not problems and proc.returncode == 0, "\n".join(problems) + (
        f"\nexit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")
