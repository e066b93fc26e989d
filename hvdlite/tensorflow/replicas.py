"""hvd.check_replicas for TensorFlow and Keras: a Keras model (its and its optimizer's variables), an
optimizer, or a collection of variables, tensors and numpy arrays."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas, flatten_tensors


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


def _variables(obj: Any) -> Optional[list]:
    """A Keras model's (and its optimizer's) variables, or a Keras optimizer's; None for anything else."""
    if hasattr(obj, "trainable_variables") and hasattr(obj, "layers"):  # a Keras model
        from .keras.variables import model_and_optimizer_variables
        return model_and_optimizer_variables(obj, build_optimizer=False)
    if hasattr(obj, "apply_gradients") and hasattr(obj, "variables"):  # a Keras optimizer
        variables = obj.variables
        return list(variables() if callable(variables) else variables)
    return None


def named_tensors(obj: Any) -> list:
    """(name, numpy array) for each variable or tensor of ``obj``."""
    variables = _variables(obj)
    if variables is None:
        return flatten_tensors(obj, _leaf)
    return [(getattr(v, "path", None) or v.name, _leaf(v)) for v in variables]


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """Check that ``obj`` (a Keras model with its optimizer's state, a Keras optimizer, or a collection of
    variables, tensors and numpy arrays) is bit-identical on every rank of ``process_set``; returns how many
    tensors were compared. One small gather of 64-bit digests; when any differs, only the first differing
    tensor is gathered and ``hvd.ReplicaDivergenceError`` is raised on every rank naming it, the ranks that
    differ and the largest absolute difference. Every rank must call it."""
    return check_named_replicas(named_tensors(obj), process_set)


__all__ = ["check_replicas", "named_tensors"]
