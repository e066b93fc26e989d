"""SyncBatchNormalization for tf-keras (Keras 2): what ``hvd.SyncBatchNormalization(...)`` builds under
TF_USE_LEGACY_KERAS=1, so it works wherever tf-keras layers do (eagerly, tf.function, tf.compat.v1 sessions).

Imported only once tf-keras is in use (keras_families decides); the statistics are sync_batch_norm.py's.
"""
from __future__ import annotations

from typing import Any, Optional

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import logger

from .keras_families import KERAS2
from .batch_norm_stats import synced_moments

tf_keras: Any = KERAS2.module()  # the tf-keras package, found at run time

__all__ = ["SyncBatchNormalization"]


@tf_keras.utils.register_keras_serializable(package="hvdlite")
class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
    """tf-keras BatchNormalization whose training statistics cover the batches of every rank of ``process_set``.

    ``fused`` is accepted with any value and ignored (the fused kernel computes its own statistics, so this
    layer never uses it); the other arguments are tf-keras BatchNormalization's.
    """

    def __init__(self, fused: Optional[bool] = False, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        if fused is not False:
            logger.debug("SyncBatchNormalization: fused=%r ignored (the statistics come from every rank)", fused)
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(fused=False, **kwargs)
        self.process_set = process_set

    def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool,
                                mask: Any = None) -> Any:
        ps = self.process_set
        if not ps.included() or ps.size() == 1:
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        return synced_moments(inputs, [int(a) for a in reduction_axes], mask, ps, keep_dims)

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("fused", None)
        return config
