"""hvdlite.tensorflow.keras.elastic (also hvdlite.keras.elastic): KerasState and the elastic Keras callbacks."""
from __future__ import annotations

from typing import Any

from hvdlite.core.elastic import HostsUpdatedInterrupt, ObjectState, State, run
from hvdlite.tensorflow.elastic import TensorFlowKerasState

from .callbacks import AnyKerasCallback

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "HostsUpdatedInterrupt"]


KerasState = TensorFlowKerasState  # Horovod's hvd.elastic.KerasState(model, optimizer=None, **kwargs)


class CommitStateCallback(AnyKerasCallback):
    """Commit the state every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(AnyKerasCallback):
    """Keep ``state.batch`` at the number of batches done in the current epoch."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(AnyKerasCallback):
    """Count finished epochs in ``state.epoch`` (resume with ``fit(..., epochs=total - state.epoch)``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch += 1
