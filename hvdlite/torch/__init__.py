"""hvdlite.torch: a drop-in for ``horovod.torch`` (``import hvdlite.torch as hvd``)."""
from __future__ import annotations

from hvdlite.core import allgather_object, basics, broadcast_object
from hvdlite.core.basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__

from .async_ops import (allgather_async, allreduce_, allreduce_async, allreduce_async_, alltoall_async, barrier,
                        broadcast_, broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                        grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async, join, poll,
                        reducescatter_async, sparse_allreduce_async, synchronize)
from .collectives import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                          grouped_reducescatter, reducescatter)
from .compression import Compression, Compressor
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .replicas import check_replicas
from .sync_batch_norm import SyncBatchNorm
from .zero import ZeroRedundancyOptimizer
from . import elastic  # noqa: E402  (hvd.elastic.TorchState, ElasticSampler, run)

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize",
    "Compression", "Compressor", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "SyncBatchNorm", "ZeroRedundancyOptimizer", "elastic",
    "check_replicas",
]
__all__ += basics.__all__  # init, rank, size, ..., process sets, errors, reduce ops

from . import mpi_ops  # noqa: E402,F401  (hvd.mpi_ops, as horovod.torch.mpi_ops)
