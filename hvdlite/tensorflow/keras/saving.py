"""load_model: load a saved Keras 3 model and hand it back with its optimizer wrapped for hvdlite."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from hvdlite.core.frontend import logger

from ..compression import Compression
from .optimizer import DistributedOptimizer, DistributedOptimizerMixin, copy_optimizer_state


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict] = None, compression: type = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a ``.keras`` (or ``.h5``) model; its optimizer comes back as a DistributedOptimizer.

    The optimizer keeps the state that was saved with it (step count, slot variables). Optimizer classes
    in ``custom_optimizers`` and objects in ``custom_objects`` are made known to Keras for loading.
    ``legacy_opts`` (Horovod: wrap ``tf.keras.optimizers.legacy`` classes) is accepted and ignored: Keras 3 has
    no legacy optimizers, so the saved optimizer's own class is used.
    """
    if legacy_opts:
        logger.debug("load_model: legacy_opts=True ignored (Keras 3 has no legacy optimizers)")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
        objects.setdefault(keras.saving.get_registered_name(cls), cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or isinstance(optimizer, DistributedOptimizerMixin):
        return model
    wrapped = DistributedOptimizer(optimizer, compression=compression)
    copy_optimizer_state(optimizer, wrapped, model.trainable_variables)
    model.optimizer = wrapped
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None and isinstance(getattr(compile_config, "config", None), dict):
        compile_config.config["optimizer"] = wrapped  # so that saving the model again saves this optimizer
    return model
