"""TensorFlow's topology ops (``hvd.rank_op()``, ``size_op()``, ...): int32 scalars read when the graph runs."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from hvdlite import core
from hvdlite.core.frontend import process_set_ranks
from hvdlite.tensorflow.mpi_ops import _in_xla_context


def _value_op(value: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    """An int32 scalar computed when the graph runs (a constant under XLA or eagerly)."""
    if tf.executing_eagerly() or _in_xla_context():
        return tf.constant(value(), dtype=tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    return _value_op(core.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    return _value_op(core.local_rank, name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return _value_op(lambda: len(process_set_ranks(int(process_set_id))), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    return _value_op(core.local_size, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return _value_op(lambda: int(core.rank() in process_set_ranks(int(process_set_id))), name)
