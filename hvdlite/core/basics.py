"""The runtime names every frontend re-exports (init, rank, size, ..., process sets, reduce ops, errors).

Part of the frontend interface: a frontend writes ``from hvdlite.core.basics import *`` and
``__all__ += basics.__all__``, so the list is written once and every name is visible to type checkers.
"""
from __future__ import annotations

from typing import Any

from .build_flags import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                          mpi_enabled, nccl_built, rocm_built)
from .engine import mpi
from .engine.handles import Handle
from .errors import (DuplicateNameError, HorovodInternalError, HvdliteError, InvalidArgumentError, LaunchError,
                     NotInitializedError, ReplicaDivergenceError, ShutdownError, StallError, TensorMismatchError)
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank, local_size,
                      mpi_threads_supported, rank, shutdown, size, state)

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


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    return state().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all ranks must call this). Returns True if removed."""
    return state().remove_process_set(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0 writes it)."""
    st = state()
    if st.rank == 0:
        st.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    state().timeline.stop()


def engine_stats() -> dict[str, int]:
    """Counters of the engine: negotiation cycles, full rounds, MPI data calls."""
    return state().engine.stats()


def straggler_report() -> dict[str, Any]:
    """How late the latest ranks submitted the last ``straggler_window_ops`` agreed ops, and the straggler (or
    None): the same dict on every rank read at the same point of the program (engine/stragglers.py)."""
    return state().engine.stragglers.report()


class HorovodBasics:
    """Horovod's ``hvd.mpi_ops._basics``: the names above, and the process-set queries Horovod's tests use."""

    def __getattr__(self, name: str) -> Any:
        if name not in __all__:
            raise AttributeError(name)
        return globals()[name]

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """Every registered process set: id -> its global ranks (the same table on every rank)."""
        return {ps_id: list(ranks) for ps_id, ranks in sorted(state().psets.ranks.items())}

    @staticmethod
    def _comm_process_set_id(comm: Any) -> int:
        """The id of the registered set of ``comm``'s ranks."""
        st = state()
        ranks = mpi.communicator_world_ranks(comm, st.world)
        ps_id = None if ranks is None else st.psets.find(ranks)
        if ps_id is None:
            raise ValueError(f"rank {st.rank}: the MPI communicator (ranks {ranks}) is no registered process set")
        return ps_id


_basics = HorovodBasics()
