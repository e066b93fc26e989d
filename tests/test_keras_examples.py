"""The TensorFlow/Keras examples converge under mpiexec -n 2 (at least 95% test accuracy on digits)."""
from __future__ import annotations

import re

import pytest
from conftest import ROOT, final_accuracy, run_mpi

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("example,checkpoint", [("keras_digits.py", "digits.keras"),
                                                ("tensorflow2_digits.py", "digits_tf2.weights.h5")])
def test_example_converges_on_two_ranks(example: str, checkpoint: str, tmp_path) -> None:
    proc = run_mpi(ROOT / "examples" / example, 2, args=["--checkpoint-dir", str(tmp_path)], timeout=300,
                   env=TF_ENV)
    assert final_accuracy(proc.stdout, proc.stderr) >= 0.95, proc.stdout
    assert (tmp_path / checkpoint).is_file(), list(tmp_path.iterdir())


def test_keras2_example_converges_on_two_ranks_and_its_h5_checkpoint_loads(tmp_path) -> None:
    """examples/keras2_digits.py: a Horovod-era Keras 2 script (tf-keras with TF_USE_LEGACY_KERAS=1)."""
    proc = run_mpi(ROOT / "examples" / "keras2_digits.py", 2,
                   args=["--checkpoint-dir", str(tmp_path), "--epochs", "8"], timeout=300,
                   env={**TF_ENV, "TF_USE_LEGACY_KERAS": "1"})
    accuracy = final_accuracy(proc.stdout, proc.stderr)
    assert accuracy >= 0.95, proc.stdout
    restored = re.findall(r"^restored_accuracy=([0-9.]+)$", proc.stdout, flags=re.M)
    assert [float(r) for r in restored] == [accuracy], proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_keras2.h5"]
