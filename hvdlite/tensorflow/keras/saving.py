"""load_model: load a saved Keras model (Keras 3 or tf-keras) and hand it back with its optimizer wrapped."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hvdlite.core.frontend import logger

from ..compression import Compression
from ..keras_families import KERAS3, tf_keras_family
from .optimizer import DistributedOptimizer, DistributedOptimizerMixin


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict] = None, compression: type = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a saved model; its optimizer comes back as a DistributedOptimizer with the state saved with it.

    A ``.keras`` file is loaded with Keras 3; an ``.h5`` file or a SavedModel directory with the Keras that
    ``tf.keras`` is (tf-keras when TF_USE_LEGACY_KERAS=1, else Keras 3). Optimizer classes in
    ``custom_optimizers`` and objects in ``custom_objects`` are made known to Keras for loading. With
    ``legacy_opts`` (Horovod's meaning) tf-keras loads the optimizer as its ``tf.keras.optimizers.legacy``
    class; Keras 3 has no legacy optimizers, so there it is ignored.
    """
    family = KERAS3 if str(filepath).endswith(".keras") else tf_keras_family()
    if legacy_opts and family is KERAS3:
        logger.debug("load_model: legacy_opts=True ignored (Keras 3 has no legacy optimizers)")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
        objects.setdefault(family.module().saving.get_registered_name(cls), cls)
    model = family.load_model(filepath, objects, legacy_opts)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or isinstance(optimizer, DistributedOptimizerMixin):
        return model
    # the loaded optimizer keeps its restored (tf-keras: maybe still pending) state: it becomes the distributed one
    wrapped = DistributedOptimizer(optimizer, compression=compression)
    optimizer.__class__ = type(wrapped)
    optimizer._hvd = wrapped._hvd
    return model
