"""examples/lightning_digits.py under mpiexec -n 2: trains, writes one checkpoint per epoch (rank 0), resumes from
the newest, tests and predicts every test row exactly once, and prints on rank 0 only."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT, final_accuracy, run_mpi

EXAMPLE = ROOT / "examples" / "lightning_digits.py"


def test_lightning_digits_trains_checkpoints_resumes_and_predicts(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = run_mpi(EXAMPLE, 2, args=["--epochs", "6", "--checkpoint-dir", str(ckpt)], timeout=300)
    assert final_accuracy(proc.stdout) >= 0.9, proc.stdout  # printed once: rank 0 only
    assert re.findall(r"^epochs=(\d+)", proc.stdout, flags=re.M) == ["6"], proc.stdout
    assert "predicted=360 of 360" in proc.stdout, proc.stdout
    files = sorted(p.name for p in ckpt.iterdir())
    assert len(files) == 6 and all(f.endswith(".ckpt") for f in files), files
    resumed = run_mpi(EXAMPLE, 2, args=["--epochs", "7", "--checkpoint-dir", str(ckpt), "--resume"], timeout=300)
    assert re.findall(r"^epochs=(\d+)", resumed.stdout, flags=re.M) == ["7"], resumed.stdout
    assert len(list(ckpt.iterdir())) == 7, sorted(p.name for p in ckpt.iterdir())
