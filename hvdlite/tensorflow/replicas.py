"""hvd.check_replicas for TensorFlow: a Keras optimizer, or a collection of variables, tensors and numpy arrays
(Keras models: hvdlite/tensorflow/keras/replicas.py)."""
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
    """A Keras optimizer's variables; None for anything else."""
    if hasattr(obj, "apply_gradients") and hasattr(obj, "variables"):  # a Keras optimizer
        variables = obj.variables
        return list(variables() if callable(variables) else variables)
    return None


def named_variables(variables: list) -> list:
    """(name, numpy array) for each variable (Keras 3's path, else its name)."""
    return [(getattr(v, "path", None) or v.name, _leaf(v)) for v in variables]


def named_tensors(obj: Any) -> list:
    """(name, numpy array) for each variable or tensor of ``obj``."""
    variables = _variables(obj)
    return flatten_tensors(obj, _leaf) if variables is None else named_variables(variables)


def check_tensors(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """hvd.check_replicas for a Keras optimizer or a collection of tensors (see the Keras frontend's)."""
    return check_named_replicas(named_tensors(obj), process_set)


__all__ = ["check_tensors", "named_tensors", "named_variables"]
