"""hvdlite.tensorflow: Horovod's ``horovod.tensorflow`` API for TensorFlow 2 (eager and tf.function)."""
from __future__ import annotations

from typing import Any

from hvdlite.core import basics
from hvdlite.core.basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__
from hvdlite.core import Average, ProcessSet, global_process_set

from .compression import Compression
from .functions import (BroadcastGlobalVariablesHook, allgather_object, broadcast_global_variables, broadcast_object,
                        broadcast_object_fn, broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (XLANotSupportedError, allgather, alltoall, barrier, broadcast, broadcast_, grouped_allgather,
                      join, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op)
from .reduction import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from .sync_batch_norm import SyncBatchNormalization
from . import elastic  # noqa: E402  (hvd.elastic)


def _library_code_for_autograph() -> None:
    """Have AutoGraph call hvdlite's functions as they are, as it does TensorFlow's own, instead of converting
    them (a Keras custom loop's first trace: 1.49 -> 0.32 s)."""
    from tensorflow.python.autograph.core import config
    if not any(getattr(r, "_prefix", None) == "hvdlite" for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert("hvdlite"), *config.CONVERSION_RULES)


_library_code_for_autograph()


def DistributedOptimizer(optimizer: Any, name: Any = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: type = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a TF1 ``tf.compat.v1.train.Optimizer`` (as Horovod does), or a Keras one (with
    ``hvdlite.tensorflow.keras.DistributedOptimizer``), so it combines the gradients over all ranks."""
    import tensorflow as tf

    from .optimizer_v1 import DistributedTF1Optimizer
    from .reduction import gradient_settings

    if isinstance(optimizer, tf.compat.v1.train.Optimizer):  # GradientDescentOptimizer, MomentumOptimizer, ...
        settings = gradient_settings(op, gradient_predivide_factor, groups, compression, sparse_as_dense, process_set,
                                     scale_local_gradients, backward_passes_per_step, average_aggregated_gradients)
        return DistributedTF1Optimizer(optimizer, settings, name=name, use_locking=use_locking)

    from .keras_families import family_of
    from .keras.optimizer import DistributedOptimizer as _keras_distributed

    try:
        family_of(optimizer, "optimizer", "hvdlite.tensorflow.DistributedOptimizer")
    except ValueError as error:
        raise ValueError(f"{error}, or a TF1 tf.compat.v1.train.Optimizer. For a custom training loop use "
                         f"hvd.DistributedGradientTape instead.") from None

    return _keras_distributed(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                              gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
                              num_groups, groups, process_set, scale_local_gradients)  # (Keras' argument order)


__all__ = [
    "elastic", "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "barrier", "broadcast_variables", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "DistributedGradientTape",
    "PartialDistributedGradientTape", "DistributedOptimizer", "Compression", "SyncBatchNormalization",
    "XLANotSupportedError", "BroadcastGlobalVariablesHook", "check_replicas",
]
__all__ += basics.__all__  # init, rank, size, ..., process sets, errors, reduce ops


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """hvd.check_replicas for Keras models, optimizers and TF/numpy tensors (hvdlite.tensorflow.keras's)."""
    from .keras.variables import check_replicas as check  # Keras is imported only when this is used
    return check(obj, process_set)
