"""hvdlite.torch: a drop-in for ``horovod.torch`` (``import hvdlite.torch as hvd``)."""
from __future__ import annotations

from hvdlite.core import (HvdliteError, ProcessSet, add_process_set, ccl_built, cross_rank, cross_size,
                          cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, init,
                          is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                          mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built, shutdown, size,
                          start_timeline, stop_timeline)
from hvdlite.core import HorovodInternalError

from .mpi_ops import (  # first: it imports .collectives at its end
                      Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_, allreduce_async,
                      allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
                      grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter_async, join, poll, reducescatter_async,
                      sparse_allreduce_async, synchronize)
from .collectives import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                          grouped_reducescatter, reducescatter)
from .compression import Compression, Compressor
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from .zero import ZeroRedundancyOptimizer
from . import elastic  # noqa: E402  (hvd.elastic.TorchState, ElasticSampler, run)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "HvdliteError",
    "Compression", "Compressor", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "SyncBatchNorm", "ZeroRedundancyOptimizer", "elastic",
]
