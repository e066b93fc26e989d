"""Smoke runs of the ZeroRedundancyOptimizer benchmarks with tiny sizes: well-formed JSON, state really 1/N.

Nothing here looks at a timing.
"""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, json_lines, run_mpi

BENCH = ROOT / "benchmarks"


def test_zero_memory_reports_sharded_state() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "zero_memory.py"), "--ranks", "1,2", "--scale", "0.001",
                           "--steps", "1", "--timeout", "240"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    records = json_lines(proc.stdout)
    jobs = {(r["optimizer"], r["ranks"]): r for r in records if "optimizer" in r}
    assert sorted(jobs) == [("dist", 1), ("dist", 2), ("zero", 1), ("zero", 2)]
    full = 2 * jobs["dist", 1]["model_bytes"]  # AdamW's two moments
    assert [p["state_bytes"] for p in jobs["dist", 2]["per_rank"]] == [full, full]
    for p in jobs["zero", 2]["per_rank"]:  # half, plus under one padding element per bucket and moment
        assert full / 2 <= p["state_bytes"] <= full / 2 + 2 * 4 * 199, p
    summary = records[-1]
    assert summary["kind"] == "summary" and [row["ranks"] for row in summary["rows"]] == [1, 2]


def test_zero_throughput_reports_every_method() -> None:
    proc = run_mpi(BENCH / "zero_throughput.py", 2, args=["--rounds", "1", "--steps", "1", "--warmup", "0",
                                                          "--batch-size", "2", "--seq", "8"], timeout=300)
    records = json_lines(proc.stdout)
    rates = {r["method"]: r["samples_per_s"] for r in records if "method" in r}
    assert sorted(rates) == ["hvdlite_distributed", "hvdlite_zero", "torch_zero_ddp_gloo"]
    assert all(rate > 0 for rate in rates.values())
    assert {"zero_vs_distributed", "zero_vs_torch_zero"} <= set(records[-1])
