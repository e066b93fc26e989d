"""examples/pytorch_digits_zero.py reaches 95% at -n 2 and its consolidated checkpoint resumes at -n 3."""
from __future__ import annotations

import re

from conftest import ROOT, final_accuracy, run_mpi

EXAMPLE = ROOT / "examples" / "pytorch_digits_zero.py"


def test_digits_zero_trains_to_95_percent_and_resumes_at_another_size(tmp_path) -> None:
    ckpt = tmp_path / "digits_zero.pt"
    proc = run_mpi(EXAMPLE, 2, args=["--checkpoint", str(ckpt)], timeout=240)
    assert final_accuracy(proc.stdout) >= 0.95, proc.stdout
    assert proc.stdout.count("epoch=") == 10, proc.stdout  # logged on rank 0 only
    resumed = run_mpi(EXAMPLE, 3, args=["--resume", str(ckpt), "--epochs", "11"], timeout=240)
    assert f"resumed from {ckpt} at epoch 10" in resumed.stdout, resumed.stdout
    assert re.findall(r"^epoch=(\d+)", resumed.stdout, flags=re.M) == ["11"], resumed.stdout
    assert final_accuracy(resumed.stdout) >= 0.95, resumed.stdout
