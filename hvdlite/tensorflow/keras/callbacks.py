"""Keras callbacks (Keras 3 and tf-keras) for data-parallel training: broadcast, metric averaging, lr, checkpoint."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils.io_utils import print_msg

from hvdlite import core
from hvdlite.core import Average

from ..functions import broadcast_variables
from ..keras_families import family_of, model_family
from .variables import check_replicas, model_and_optimizer_variables


class AnyKerasCallback(keras.callbacks.Callback):
    """A Keras 3 callback that tf-keras' ``model.fit`` accepts as well (it asks which batch hooks it implements)."""

    _supports_tf_logs = False

    def _overrides(self, *hooks: str) -> bool:
        return any(getattr(type(self), h) is not getattr(keras.callbacks.Callback, h) for h in hooks)

    def _implements_train_batch_hooks(self) -> bool:
        return self._overrides("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")

    def _implements_test_batch_hooks(self) -> bool:
        return self._overrides("on_test_batch_begin", "on_test_batch_end")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._overrides("on_predict_batch_begin", "on_predict_batch_end")


class CheckReplicasCallback(AnyKerasCallback):
    """hvd.check_replicas of the model and its optimizer after every ``every_n_batches``-th training batch, or (0,
    the default) at the end of each epoch."""

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


class BroadcastGlobalVariablesCallback(AnyKerasCallback):
    """Broadcast the model's and optimizer's variables from ``root_rank`` once: in ``on_train_begin`` for a
    built model, else after the first batch (docs/tensorflow.md). ``local_variables`` are left alone."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        kinds = (tf.Variable, keras.Variable)
        local_variables = [local_variables] if isinstance(local_variables, kinds) else list(local_variables or [])
        if not all(isinstance(v, kinds) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type (or Keras variables).")
        self.local_variables: list = local_variables

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own value."""
        self.local_variables.append(var)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        model_family(self.model, type(self).__name__)  # refuses a model and optimizer of different Keras
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def _broadcast(self) -> None:
        local = {id(v) for v in self.local_variables}
        local |= {id(getattr(v, "value", None)) for v in self.local_variables if isinstance(v, keras.Variable)}
        variables = [v for v in model_and_optimizer_variables(self.model)
                     if id(v) not in local and id(getattr(v, "value", None)) not in local]
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(AnyKerasCallback):
    """Replace each epoch-end metric (training and validation) by its average over all ranks."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is None or core.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype,
                                                                                     np.number))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        logs.update(zip(keys, core.allreduce(values, op=Average).tolist()))


def _current_lr(optimizer: Any) -> float:
    return float(np.asarray(optimizer.learning_rate))  # a Keras 3 variable, a tf.Variable or a float


class LearningRateScheduleCallback(AnyKerasCallback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``: a
    constant ``multiplier`` decays exponentially; ``staircase=False`` adjusts before every batch with fractional
    epochs; ``momentum_correction``: see docs/tensorflow.md."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: Optional[int] = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        model_family(self.model, type(self).__name__)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = int((self.params or {}).get("steps") or 0)
            if not self.steps_per_epoch:
                raise ValueError(f"Could not autodetect the number of steps per epoch (fit() was given no length); "
                                 f"pass steps_per_epoch= to {type(self).__name__}()")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        epoch = self.current_epoch or 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _current_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            _correct_momentum(optimizer, new_lr / old_lr)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = _current_lr(self.model.optimizer)


def _correct_momentum(optimizer: Any, ratio: float) -> None:
    """Horovod's momentum correction (momentum times ``ratio`` for one step) as a scaling of the velocities,
    which also works where the momentum is a constant of a traced function."""
    if not float(np.asarray(getattr(optimizer, "momentum", 0) or 0)):
        return
    for velocity in family_of(optimizer, "optimizer", "momentum_correction").velocities(optimizer):
        velocity.assign(velocity * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al., 2017)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch  # round numbers at the end of each epoch
            n = core.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and core.rank() == 0:
            print_msg(f"Epoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{_current_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best model seen so far (by ``monitor``); only rank 0 writes the file, at ``callback.filepath``
    (set as Horovod's Spark estimator does) or the keyword ``filepath=``."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch", *, filepath: Optional[str] = None) -> None:
        placeholder = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=placeholder if filepath is None else filepath, monitor=monitor,
                         verbose=verbose if core.rank() == 0 else 0, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath if filepath is None else self.filepath

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no file to write: set callback.filepath = 'best.keras' (as "
                             "Horovod's Spark estimator does) or pass filepath= before calling fit()")
        self.filepath = str(self.filepath)
        ok = (".weights.h5",) if self.save_weights_only else (".keras", ".h5")
        if not self.filepath.endswith(ok):
            raise ValueError(f"BestModelCheckpoint: filepath {self.filepath!r} must end in {' or '.join(ok)} "
                             f"(save_weights_only={self.save_weights_only})")
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if core.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if core.rank() == 0:
            super().on_epoch_end(epoch, logs)
