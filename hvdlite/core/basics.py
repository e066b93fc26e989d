"""The runtime names every frontend re-exports (init, rank, size, ..., process sets, reduce ops, errors).

Part of the frontend interface: a frontend writes ``from hvdlite.core.basics import *`` and
``__all__ += basics.__all__``, so the list is written once and every name is visible to type checkers.
"""
from __future__ import annotations

from typing import Any

from .build_flags import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                          mpi_enabled, nccl_built, rocm_built)
from .engine.handles import Handle
from .errors import (DuplicateNameError, HorovodInternalError, HvdliteError, InvalidArgumentError, LaunchError,
                     NotInitializedError, ReplicaDivergenceError, ShutdownError, StallError, TensorMismatchError)
from .process_set_ops import add_process_set, comm_process_set_id, process_set_ids_and_ranks, remove_process_set
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank, local_size,
                      mpi_threads_supported, rank, shutdown, size)
from .timeline_control import start_timeline, stop_timeline, straggler_report

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "Handle", "HvdliteError",
    "HorovodInternalError", "NotInitializedError", "TensorMismatchError", "DuplicateNameError",
    "ShutdownError", "StallError", "LaunchError", "InvalidArgumentError", "ReplicaDivergenceError",
    "straggler_report", "gpu_available",
]


class HorovodBasics:
    """Horovod's ``hvd.mpi_ops._basics``: the names above, and the process-set queries Horovod's tests use."""

    def __getattr__(self, name: str) -> Any:
        if name not in __all__:
            raise AttributeError(name)
        return globals()[name]

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        return process_set_ids_and_ranks()

    @staticmethod
    def _comm_process_set_id(comm: Any) -> int:
        return comm_process_set_id(comm)


_basics = HorovodBasics()
