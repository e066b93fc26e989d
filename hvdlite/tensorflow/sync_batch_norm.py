"""SyncBatchNormalization: a Keras 3 BatchNormalization whose training statistics cover every rank's batch."""
from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import logger

from .keras_families import KERAS2, tf_keras_family
from .batch_norm_stats import synced_moments

#: Keyword arguments of Keras 2's BatchNormalization that Keras 3 dropped, with the value that means "off".
_DROPPED = {"virtual_batch_size": None, "adjustment": None}


class _SyncBatchNormalizationMeta(type):
    """``SyncBatchNormalization(...)`` builds the tf-keras layer when tf.keras is tf-keras (TF_USE_LEGACY_KERAS=1)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is SyncBatchNormalization and tf_keras_family() is KERAS2:
            from .sync_batch_norm_keras2 import SyncBatchNormalization as TfKerasSyncBatchNormalization
            return TfKerasSyncBatchNormalization(*args, **kwargs)
        return super().__call__(*args, **kwargs)


@keras.saving.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(keras.layers.BatchNormalization, metaclass=_SyncBatchNormalizationMeta):
    """Batch normalization with mean and variance computed over the union of the batches of every rank of
    ``process_set`` (default: all ranks).

    The statistics come from hvdlite's one SyncBatchNorm algorithm (the same as hvdlite.torch): the global
    mean first, then the mean of squared deviations from it (two allreduces, numerically stable), so ranks
    may hold batches of different sizes. Gradients flow through both allreduces. Outside training it uses
    the moving statistics, as usual.

    ``fused`` (Horovod's default False) is accepted with any value and ignored: Keras 3 has no fused kernel.
    When ``tf.keras`` is tf-keras (TF_USE_LEGACY_KERAS=1), this builds the tf-keras layer of the same name
    (sync_batch_norm_keras2.py), as Horovod's is a ``tf.keras`` layer.
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
        return synced_moments(inputs, list(self._reduction_axes), mask, ps, keep_dims=False)

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
