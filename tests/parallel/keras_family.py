"""The Keras an in-rank Keras test runs under: tf-keras (Keras 2) in its TF_USE_LEGACY_KERAS=1 variant (the
file's VARIANTS line), else Keras 3; and the few calls that differ between them."""
from __future__ import annotations

import os
from typing import Any, List

import numpy as np
import tensorflow as tf

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
if LEGACY:
    import tf_keras as keras
else:
    import keras
assert tf.keras.__name__.startswith("tf_keras") == LEGACY, tf.keras.__name__  # the variant took effect

#: The SGD of the family's classic Horovod programs: Keras 2's legacy SGD (``lr=``), or Keras 3's SGD.
SGD = keras.optimizers.legacy.SGD if LEGACY else keras.optimizers.SGD
SUFFIX = ".h5" if LEGACY else ".keras"


def optimizer_variables(optimizer: Any) -> List[Any]:
    found = optimizer.variables
    return list(found) if isinstance(found, list) else list(found())


def apply(optimizer: Any, grads: List[Any], variables: List[Any]) -> None:
    if LEGACY:
        optimizer.apply_gradients(zip(grads, variables))
    else:
        optimizer.apply(grads, variables)


def variable(value: Any) -> Any:
    return tf.Variable(value) if LEGACY else keras.Variable(value)


def value(x: Any) -> float:
    return float(np.asarray(x))
