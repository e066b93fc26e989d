"""hvd.check_replicas for Keras models (their and their optimizers' variables), optimizers and tensors, and
CheckReplicasCallback for model.fit."""
from __future__ import annotations

from typing import Any, Optional

import keras

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas

from ..keras_families import FAMILIES
from ..replicas import check_tensors, named_variables
from .variables import model_and_optimizer_variables


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """Check that ``obj`` (a Keras model with its optimizer's state, a Keras optimizer, or a collection of
    variables, tensors and numpy arrays) is bit-identical on every rank of ``process_set``; returns how many
    tensors were compared. One small gather of 64-bit digests; when any differs, only the first differing
    tensor is gathered and ``hvd.ReplicaDivergenceError`` is raised on every rank naming it, the ranks that
    differ and the largest absolute difference. Every rank must call it. Layers' random-seed state (Dropout)
    is left out: it differs per rank on purpose."""
    if any(family.owns(obj, "model") for family in FAMILIES):  # Keras 3 or tf-keras
        return check_named_replicas(named_variables(model_and_optimizer_variables(obj, build_optimizer=False)),
                                    process_set)
    return check_tensors(obj, process_set)


class CheckReplicasCallback(keras.callbacks.Callback):
    """Check that the model's and optimizer's variables are bit-identical on every rank: after every
    ``every_n_batches``-th training batch, or (0, the default) at the end of each epoch. A divergence raises
    ``hvd.ReplicaDivergenceError`` on every rank, naming the variable, the ranks and the largest difference."""

    def __init__(self, every_n_batches: int = 0) -> None:
        super().__init__()
        if every_n_batches < 0:
            raise ValueError(f"every_n_batches must be >= 0, got {every_n_batches}")
        self.every_n_batches = int(every_n_batches)
        self._batches = 0

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._batches += 1
        if self.every_n_batches and self._batches % self.every_n_batches == 0:
            check_replicas(self.model)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> Any:
        if not self.every_n_batches:
            check_replicas(self.model)


__all__ = ["CheckReplicasCallback", "check_replicas"]
