"""hvd.check_replicas for TensorFlow: a Keras model (its and its optimizer's variables), a Keras optimizer, or a
collection of variables, tensors and numpy arrays (its callback, CheckReplicasCallback, is in callbacks.py)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas, flatten_tensors

from ..keras_families import FAMILIES
from .variables import model_and_optimizer_variables


def _leaf(value: Any) -> Optional[np.ndarray]:
    if isinstance(value, (tf.Variable, tf.Tensor)) or hasattr(value, "numpy") and hasattr(value, "dtype") \
            and hasattr(value, "shape") and not isinstance(value, np.ndarray):
        array = np.asarray(value.numpy())
        return array.astype(np.float32) if array.dtype.name == "bfloat16" else array  # exact widening
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    return None


def _named(variables: list) -> list:
    """(name, numpy array) for each variable (Keras 3's path, else its name)."""
    return [(getattr(v, "path", None) or v.name, _leaf(v)) for v in variables]


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """Check that ``obj`` (a Keras model with its optimizer's state, a Keras optimizer, or a collection of
    variables, tensors and numpy arrays) is bit-identical on every rank of ``process_set``; returns how many
    tensors were compared. One small gather of 64-bit digests; when any differs, only the first differing
    tensor is gathered and ``hvd.ReplicaDivergenceError`` is raised on every rank naming it, the ranks that
    differ and the largest absolute difference. Every rank must call it. Layers' random-seed state (Dropout)
    is left out: it differs per rank on purpose."""
    if any(family.owns(obj, "model") for family in FAMILIES):  # Keras 3 or tf-keras
        named = _named(model_and_optimizer_variables(obj, build_optimizer=False))
    elif hasattr(obj, "apply_gradients") and hasattr(obj, "variables"):  # an optimizer
        named = _named(list(obj.variables() if callable(obj.variables) else obj.variables))
    else:
        named = flatten_tensors(obj, _leaf)
    return check_named_replicas(named, process_set)


__all__ = ["check_replicas"]
