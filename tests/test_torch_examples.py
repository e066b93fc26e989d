"""The PyTorch examples: digits reaches 95% at -n 2 and resumes from a checkpoint; the benchmark runs."""
from __future__ import annotations

import re

from conftest import ROOT, final_accuracy, run_mpi

DIGITS = ROOT / "examples" / "pytorch_digits.py"
BENCHMARK = ROOT / "examples" / "pytorch_synthetic_benchmark.py"


def test_digits_trains_to_95_percent_checkpoints_and_resumes(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = run_mpi(DIGITS, 2, args=["--checkpoint-dir", str(ckpt)], timeout=240)
    assert final_accuracy(proc.stdout) >= 0.95, proc.stdout
    assert proc.stdout.count("epoch=") == 10, proc.stdout  # logged once per epoch: on rank 0 only
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(f"checkpoint-{e}.pt" for e in range(1, 11))
    resumed = run_mpi(DIGITS, 2, args=["--checkpoint-dir", str(ckpt), "--resume", "--epochs", "11"],
                      timeout=240)
    assert f"resumed from {ckpt / 'checkpoint-10.pt'} at epoch 10" in resumed.stdout, resumed.stdout
    assert re.findall(r"^epoch=(\d+)", resumed.stdout, flags=re.M) == ["11"], resumed.stdout
    assert final_accuracy(resumed.stdout) >= 0.95, resumed.stdout
    assert (ckpt / "checkpoint-11.pt").exists()


def test_digits_with_adasum_converges() -> None:
    """--use-adasum: DistributedOptimizer(op=hvd.Adasum) with the unscaled learning rate (Horovod's guidance)."""
    proc = run_mpi(DIGITS, 2, args=["--use-adasum", "--epochs", "6"], timeout=240)
    assert final_accuracy(proc.stdout) >= 0.9, proc.stdout


def test_synthetic_benchmark_prints_throughput() -> None:
    proc = run_mpi(BENCHMARK, 2, args=["--batch-size", "2", "--image-size", "32", "--num-warmup-batches", "1",
                                       "--num-batches-per-iter", "1", "--num-iters", "2", "--fp16-allreduce"],
                   timeout=240)
    assert "Number of CPUs: 2" in proc.stdout and proc.stdout.count("Iter #") == 2, proc.stdout
    rate = re.findall(r"^total_samples_per_sec=([0-9.]+)$", proc.stdout, flags=re.M)
    assert len(rate) == 1 and float(rate[0]) > 0, proc.stdout
