"""SyncBatchNormalization: a Keras 3 BatchNormalization whose training statistics cover every rank's batch."""
from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from hvdlite.core import ProcessSet, Sum, global_process_set
from hvdlite.core.frontend import logger, sync_moments

from .mpi_ops import _grouped_allreduce

#: Keyword arguments of Keras 2's BatchNormalization that Keras 3 dropped, with the value that means "off".
_DROPPED = {"virtual_batch_size": None, "adjustment": None}


@keras.saving.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with mean and variance computed over the union of the batches of every rank of
    ``process_set`` (default: all ranks).

    The statistics come from hvdlite's one SyncBatchNorm algorithm (the same as hvdlite.torch): the global
    mean first, then the mean of squared deviations from it (two allreduces, numerically stable), so ranks
    may hold batches of different sizes. Gradients flow through both allreduces. Outside training it uses
    the moving statistics, as usual.

    ``fused`` (Horovod's default False) is accepted with any value and ignored: Keras 3 has no fused kernel.
    """

    def __init__(self, fused: Optional[bool] = False, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        if fused is not False:
            logger.debug("SyncBatchNormalization: fused=%r ignored (Keras 3 has no fused batch norm kernel)", fused)
        for key, off in _DROPPED.items():
            if key not in kwargs:
                continue
            value = kwargs.pop(key)
            if value is not off:
                raise ValueError(f"SyncBatchNormalization: {key}={value!r} is not supported: Keras 3 dropped "
                                 f"{key!r} from BatchNormalization; remove the argument")
            logger.debug("SyncBatchNormalization: %s=%r ignored (Keras 3 dropped it)", key, value)
        if kwargs.pop("synchronized", False):
            raise ValueError("SyncBatchNormalization synchronizes through hvdlite; do not pass synchronized=True "
                             "(that is tf.distribute's mechanism)")
        kwargs.setdefault("name", "sync_batch_normalization")  # Horovod's default name
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs: tf.Tensor, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        ps = self.process_set
        if not ps.included() or ps.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        original = x.dtype
        if original in (tf.float16, tf.bfloat16):
            x = tf.cast(x, tf.float32)
        weights = None
        if mask is not None:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
        per_channel = [1] * x.shape.rank
        per_channel[self.axis] = -1

        def allreduce_sum(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
            return _grouped_allreduce(tensors, op=Sum, process_set=ps)

        mean, variance, _ = sync_moments(x, weights, lambda t: tf.reduce_sum(t, axis=axes), allreduce_sum,
                                         lambda t: tf.reshape(t, per_channel))
        if original != x.dtype:
            mean, variance = tf.cast(mean, original), tf.cast(variance, original)
        return mean, variance

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
