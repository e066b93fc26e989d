"""SyncBatchNormalization: a Keras 3 BatchNormalization whose training statistics cover every rank's batch."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import keras
import tensorflow as tf

from hvdlite import core
from hvdlite.core import Sum

from .mpi_ops import _allreduce


@keras.saving.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with mean and variance computed over the union of all ranks' batches.

    Each rank sends (sum, sum of squares, count) in one allreduce, so ranks may hold batches of different
    sizes. Gradients flow through the allreduce. Outside training it uses the moving statistics, as usual.
    """

    def __init__(self, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True (Keras 3 has no fused kernel)")
        if kwargs.pop("synchronized", False):
            raise ValueError("SyncBatchNormalization synchronizes through hvdlite; do not pass synchronized=True "
                             "(that is tf.distribute's mechanism)")
        super().__init__(**kwargs)

    def _moments(self, inputs: tf.Tensor, mask: Any) -> Tuple[tf.Tensor, tf.Tensor]:
        if not core.is_initialized() or core.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        original = x.dtype
        if original in (tf.float16, tf.bfloat16):
            x = tf.cast(x, tf.float32)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
        local_sum = tf.reduce_sum(x * weights, axis=axes)
        local_squares = tf.reduce_sum(tf.square(x) * weights, axis=axes)
        local_count = tf.reduce_sum(weights, axis=axes)
        total = _allreduce(tf.stack([local_sum, local_squares, local_count]), op=Sum)
        count = tf.maximum(total[2], tf.constant(1e-12, x.dtype))
        mean = total[0] / count
        variance = tf.maximum(total[1] / count - tf.square(mean), 0.0)
        if original != x.dtype:
            mean, variance = tf.cast(mean, original), tf.cast(variance, original)
        return mean, variance

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
