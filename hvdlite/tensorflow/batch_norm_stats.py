"""SyncBatchNormalization's statistics for TensorFlow tensors (the core's sync_moments), for both Keras' layers."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdlite.core import ProcessSet, Sum
from hvdlite.core.frontend import sync_moments

from .mpi_ops import _grouped_allreduce

__all__ = ["synced_moments"]


def synced_moments(inputs: tf.Tensor, axes: list[int], mask: Any, process_set: ProcessSet,
                   keep_dims: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and variance of ``inputs`` over ``axes`` and over every rank of ``process_set`` (the core's
    sync_moments), weighted by ``mask`` (batch-shaped, or None); half precision is computed in float32."""
    x = tf.convert_to_tensor(inputs)
    original = x.dtype
    if original in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
    weights = None
    if mask is not None:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
    kept_shape = [1 if i in axes else (x.shape[i] if x.shape[i] is not None else -1) for i in range(x.shape.rank)]

    def allreduce_sum(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        return _grouped_allreduce(tensors, op=Sum, process_set=process_set)

    mean, variance, _ = sync_moments(x, weights, lambda t: tf.reduce_sum(t, axis=axes), allreduce_sum,
                                     lambda t: tf.reshape(t, kept_shape))
    if keep_dims:
        mean, variance = tf.reshape(mean, kept_shape), tf.reshape(variance, kept_shape)
    if original != x.dtype:
        mean, variance = tf.cast(mean, original), tf.cast(variance, original)
    return mean, variance
