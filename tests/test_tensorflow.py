"""hvdlite.tensorflow and hvdlite.tensorflow.keras under mpiexec -n 2 and -n 3.

One launch per size runs tests/workers/tf_collectives.py (every hvdlite.tensorflow name, eagerly and in
tf.function, gradients, sparse tensors, DistributedGradientTape equivalence, SyncBatchNormalization, the XLA
error) and then tests/workers/keras_fit.py (model.fit and custom-loop equivalence with SGD/Adam, callbacks,
sparse gradients, backward_passes_per_step, saving and load_model, the XLA error): TensorFlow is imported once.
"""
from __future__ import annotations

from conftest import run_mpi

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def test_tensorflow_and_keras_frontends(nproc: int, tmp_path) -> None:
    proc = run_mpi("tf_keras.py", nproc, args=[str(tmp_path)], timeout=420, env=TF_ENV)
    for part in ("tensorflow", "keras"):
        for rank in range(nproc):
            assert f"OK {part} rank {rank}" in proc.stdout, proc.stdout + proc.stderr
    # BestModelCheckpoint wrote on rank 0 only; the timeline came from rank 0
    assert sorted(p.name for p in tmp_path.glob("best_rank*.keras")) == ["best_rank0.keras"]
    assert (tmp_path / "timeline.json").stat().st_size > 0
