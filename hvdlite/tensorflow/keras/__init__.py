"""hvdlite.tensorflow.keras (also ``hvdlite.keras``): Horovod's Keras API on Keras 3 and on tf-keras (Keras 2)."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdlite.core import basics
from hvdlite.core.basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__
from hvdlite.core import Average

from .. import mpi_ops as _ops
from .. import reduction as _reduction
from ..compression import Compression
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from .variables import broadcast_global_variables, check_replicas
from . import elastic  # noqa: E402  (hvd.elastic)


def _tensor(value: Any, name: Optional[str]) -> tf.Tensor:
    return value if tf.is_tensor(value) else tf.constant(value, name=name)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type = Compression.none) -> tf.Tensor:
    """Allreduce a tensor-compatible value (default op Average); returns a tensor."""
    return _reduction.allreduce(_tensor(value, name), average=average, compression=compression, op=op,
                                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allgather(value: Any, name: Optional[str] = None) -> tf.Tensor:
    """Concatenate a tensor-compatible value from every rank along its first dimension."""
    return _ops.allgather(_tensor(value, name))


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """The value of ``root_rank``, on every rank."""
    return _ops.broadcast(_tensor(value, name), root_rank)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = Average) -> tf.Tensor:
    """Reduce a tensor-compatible value and keep this rank's share of its first dimension."""
    return _reduction.reducescatter(_tensor(value, name), op=op)


__all__ = [
    "elastic", "Compression", "callbacks", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter", "load_model",
    "SyncBatchNormalization", "check_replicas",
]
__all__ += basics.__all__  # init, rank, size, ..., process sets, errors, reduce ops
