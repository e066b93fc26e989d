"""SyncBatchNormalization: a Keras 3 BatchNormalization (or, under TF_USE_LEGACY_KERAS=1, a tf-keras one) whose
training statistics cover every rank's batch."""
from __future__ import annotations

import functools
from typing import Any, Optional

import keras
import tensorflow as tf

from hvdlite.core import ProcessSet, Sum, global_process_set
from hvdlite.core.frontend import logger, sync_moments

from .keras_families import KERAS2, tf_keras_family
from .mpi_ops import _grouped_allreduce

#: Keyword arguments of Keras 2's BatchNormalization that Keras 3 dropped, with the value that means "off".
_DROPPED = {"virtual_batch_size": None, "adjustment": None}


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
    mean, variance, _ = sync_moments(x, weights, lambda t: tf.reduce_sum(t, axis=axes),
                                     functools.partial(_grouped_allreduce, op=Sum, process_set=process_set),
                                     lambda t: tf.reshape(t, kept_shape))
    if keep_dims:
        mean, variance = tf.reshape(mean, kept_shape), tf.reshape(variance, kept_shape)
    if original != x.dtype:
        mean, variance = tf.cast(mean, original), tf.cast(variance, original)
    return mean, variance


class _SyncBatchNormalizationMeta(type):
    """``SyncBatchNormalization(...)`` builds the tf-keras layer when tf.keras is tf-keras (TF_USE_LEGACY_KERAS=1)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is SyncBatchNormalization and tf_keras_family() is KERAS2:
            return _tf_keras_class()(*args, **kwargs)
        return super().__call__(*args, **kwargs)


@keras.saving.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(keras.layers.BatchNormalization, metaclass=_SyncBatchNormalizationMeta):
    """Batch normalization whose training statistics cover the batches of every rank of ``process_set`` (the
    core's sync_moments, as hvdlite.torch's; gradients flow through it). ``fused`` is ignored: Keras 3 has no
    fused kernel. When ``tf.keras`` is tf-keras this builds the tf-keras layer (:func:`_tf_keras_class`)."""

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
        return synced_moments(inputs, list(self._reduction_axes), mask, ps, keep_dims=False)

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config


@functools.cache
def _tf_keras_class() -> type:
    """The tf-keras SyncBatchNormalization, made on first use (tf-keras is imported only once its user did)."""
    tf_keras: Any = KERAS2.module()

    @tf_keras.utils.register_keras_serializable(package="hvdlite")
    class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
        """As the Keras 3 layer (``fused`` is ignored: a fused kernel would compute its own statistics)."""

        def __init__(self, fused: Optional[bool] = False, process_set: ProcessSet = global_process_set,
                     **kwargs: Any) -> None:
            if fused is not False:
                logger.debug("SyncBatchNormalization: fused=%r ignored (statistics from every rank)", fused)
            kwargs.setdefault("name", "sync_batch_normalization")
            super().__init__(fused=False, **kwargs)
            self.process_set = process_set

        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None) -> Any:
            ps = self.process_set
            if not ps.included() or ps.size() == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            return synced_moments(inputs, [int(a) for a in reduction_axes], mask, ps, keep_dims)

        def get_config(self) -> dict:
            config = super().get_config()
            config.pop("fused", None)
            return config

    return SyncBatchNormalization
