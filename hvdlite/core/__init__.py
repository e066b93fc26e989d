"""The framework-agnostic core of hvdlite: runtime, engine and collectives on numpy arrays.

Its exports are the public API (``import hvdlite as hvd``); frontends also use ``hvdlite.core.frontend``.
"""
from __future__ import annotations

from .api import (allgather_async, allreduce_async, alltoall_async, barrier, broadcast_async, grouped_allgather_async,
                  grouped_allreduce_async, grouped_reducescatter_async, join, poll, reducescatter_async, synchronize)
from .horovod_forms import (allgather, allreduce, allreduce_, allreduce_async_, alltoall, broadcast, broadcast_,
                            broadcast_async_, grouped_allgather, grouped_allreduce, grouped_allreduce_,
                            grouped_allreduce_async_, grouped_reducescatter, reducescatter, allgather_object,
                            broadcast_object)
from .basics import (Adasum, Average, DuplicateNameError, Handle, HorovodInternalError, HvdliteError,
                     InvalidArgumentError, LaunchError, Max, Min, NotInitializedError, ProcessSet, Product, ReduceOp,
                     ReplicaDivergenceError, ShutdownError, StallError, Sum, TensorMismatchError, add_process_set,
                     ccl_built, cross_rank, cross_size, cuda_built, ddl_built, engine_stats, global_process_set,
                     gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built, shutdown,
                     size, start_timeline, stop_timeline, straggler_report)
from .config import Config
from .replicas import check_replicas

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "broadcast_object",
    "allgather_object", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline", "engine_stats", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ReduceOp", "Handle", "Config", "HvdliteError", "HorovodInternalError", "NotInitializedError",
    "TensorMismatchError", "InvalidArgumentError", "DuplicateNameError", "ShutdownError", "StallError", "LaunchError",
    "ReplicaDivergenceError", "check_replicas", "straggler_report",
]
