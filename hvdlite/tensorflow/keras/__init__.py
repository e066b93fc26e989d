"""hvdlite.tensorflow.keras (also ``hvdlite.keras``): Horovod's Keras API on Keras 3 with the TensorFlow backend.

``import hvdlite.tensorflow.keras as hvd`` replaces ``import horovod.tensorflow.keras as hvd``.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdlite.core import Average
from hvdlite.core.frontend import basics

globals().update(basics())  # init, rank, size, ..., process sets, ops (Average, Sum, Adasum, ...), errors

from .. import mpi_ops as _ops
from .. import reduction as _reduction
from ..compression import Compression
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .saving import load_model
from .variables import broadcast_global_variables
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
    "elastic",
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Compression", "callbacks",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter",
    "load_model", "SyncBatchNormalization", "HvdliteError", "HorovodInternalError",
]
__all__ += sorted(set(basics()) - set(__all__))  # every runtime name basics() re-exports
from .replicas import check_replicas  # noqa: E402  (over the core's numpy-only one)
