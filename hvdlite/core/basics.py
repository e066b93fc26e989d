"""The runtime names every frontend re-exports (init, rank, size, ..., process sets, reduce ops, errors, build flags).

A frontend writes ``from hvdlite.core.basics import *`` and ``__all__ += basics.__all__``.
"""
from __future__ import annotations

from typing import Any, Callable

from .engine import mpi
from .engine.handles import Handle
from .engine.planes import built
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


#: framework name -> whether it sees a CUDA device here
_gpu_probes: dict[str, Callable[[], bool]] = {}


def register_gpu_probe(framework: str, probe: Callable[[], bool]) -> None:  # each frontend, when imported
    _gpu_probes[framework] = probe


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether frontend ``ext_base_name`` sees a CUDA device here; False for one not imported (Horovod's)."""
    probe = _gpu_probes.get("tensorflow" if ext_base_name == "keras" else ext_base_name)
    return bool(probe is not None and probe())


def mpi_built() -> bool:
    """True (as mpi_enabled): MPI is the control plane and the host data plane."""
    return True


def gloo_enabled() -> bool:
    """True when this job runs torch CPU tensors through torch.distributed's gloo (HOROVOD_CPU_OPERATIONS=GLOO)."""
    if not is_initialized():
        return False
    current = state()
    return current.config.cpu_operations == "gloo" and current.planes.has("gloo")


def gloo_built() -> bool:
    """Whether a registered frontend can run gloo here (torch.distributed with gloo)."""
    return built("gloo")


def nccl_built() -> bool:
    """Whether a registered frontend can run NCCL here (torch built with CUDA, with NCCL)."""
    return built("nccl")


def ddl_built() -> bool:
    """False (as ccl_built and rocm_built): hvdlite has no DDL, oneCCL or ROCm."""
    return False


def cuda_built() -> bool:
    """Whether a registered frontend can place tensors on CUDA devices (torch built with CUDA)."""
    return built("cuda")


mpi_enabled = mpi_built
ccl_built = rocm_built = ddl_built


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
    return state().engine.observer.stragglers.report()


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
