"""CheckReplicasCallback: hvd.check_replicas on the model and its optimizer during model.fit."""
from __future__ import annotations

from typing import Any, Optional

import keras

from ..replicas import check_replicas


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


__all__ = ["CheckReplicasCallback"]
