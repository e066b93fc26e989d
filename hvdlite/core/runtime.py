"""The MPI runtime: init(), shutdown(), topology (rank, local_rank, cross_rank...) and build flags."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import Any, Optional, Sequence

from . import log
from .config import Config
from .engine import Engine
from .errors import LaunchError, NotInitializedError
from .launch_check import check_launch
from .log import logger
from .process_sets import ProcessSet, Registry
from .reduce_ops import MPIOps
from .timeline import Timeline


class State:
    """Everything that exists between init() and shutdown()."""

    def __init__(self, MPI: Any, world: Any, config: Config) -> None:
        self.MPI = MPI
        self.config = config
        self.world = world
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self.local_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = world.Split(self.local_rank, key=self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        node_sizes = self.cross_comm.allgather(self.local_size) if self.local_rank == 0 else None
        self.homogeneous = len(set(self.local_comm.bcast(node_sizes, root=0))) == 1
        self.engine_comm = world.Dup()
        self.thread_level = MPI.Query_thread()
        self.mpi_ops = MPIOps(MPI)
        self.timeline = Timeline()
        self.psets = Registry(self.engine_comm, self.rank, self.size)
        self.engine = Engine(self.engine_comm, self.mpi_ops, config, self.timeline, self.psets)

    def close(self) -> None:
        self.engine.stop()
        self.timeline.stop()
        if not self.engine.alive:
            self.psets.free()
            self.mpi_ops.free()
            for comm in (self.engine_comm, self.cross_comm, self.local_comm, self.world):
                comm.Free()


_state: Optional[State] = None
_lock = threading.RLock()
_atexit_registered = False
_previous_excepthook: Any = None
_ABORT_GRACE_S = 1.0  # seconds between printing an uncaught exception and MPI_Abort


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet] | str] = None, **settings: Any) -> None:
    """Start hvdlite: bring up MPI, work out the topology and start the engine thread.

    ``comm`` may be an mpi4py communicator or a list of ranks of MPI_COMM_WORLD; ``process_sets``
    registers ProcessSets at once; other keywords override settings (see ``Config``).
    Calling init() again while initialized does nothing.
    """
    global _state, _atexit_registered
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSets, or 'dynamic' "
                             f"(hvdlite always allows add_process_set() later)")
        process_sets = None
    with _lock:
        if _state is not None:
            return
        config = Config.from_env(**settings)
        from .api import reset_names
        reset_names()
        log.set_level(config.log_level)
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
        world = _make_world(MPI, comm)
        log.set_rank(world.Get_rank())
        check_launch(MPI.COMM_WORLD.Get_size())  # the job as launched, not a sub-world from comm=
        state = State(MPI, world, config)
        _state = state
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        if config.abort_on_error:
            _install_excepthook()
        if config.timeline and state.rank == 0:
            state.timeline.start(config.timeline, config.timeline_mark_cycles)
    for ps in process_sets or ():
        from .process_set_ops import add_process_set
        add_process_set(ps)


def _make_world(MPI: Any, comm: Any) -> Any:
    if comm is None:
        return MPI.COMM_WORLD.Dup()
    if isinstance(comm, MPI.Comm):
        return comm.Dup()
    ranks = sorted({int(r) for r in comm})
    me = MPI.COMM_WORLD.Get_rank()
    sub = MPI.COMM_WORLD.Split(0 if me in ranks else MPI.UNDEFINED, key=me)
    if sub == MPI.COMM_NULL:
        raise LaunchError(f"rank {me} of MPI_COMM_WORLD is not in init(comm={ranks}); only the listed ranks "
                          f"may call init() with it")
    return sub


def shutdown() -> None:
    """Stop the engine on every rank. Idempotent; init() may be called again afterwards."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.close()


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - never mask the interpreter's own exit status
        logger.debug("shutdown at exit failed", exc_info=True)


def _install_excepthook() -> None:
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def abort_job(exc_type: Any, exc: BaseException, tb: Any) -> None:
        state = _state
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[hvdlite rank {state.rank if state else '?'}] uncaught exception; aborting the "
                         f"whole job so other ranks do not wait for this one:\n{text}")
        sys.stderr.flush()
        if state is not None and state.size > 1 and not issubclass(exc_type, KeyboardInterrupt):
            # The launcher forwards this rank's output and its abort request on separate channels; when
            # the abort wins, the traceback above can be lost. Give the output a moment to get through.
            time.sleep(_ABORT_GRACE_S)
            state.MPI.COMM_WORLD.Abort(1)
            # MPICH's MPI_Abort can return while the launcher tears the job down; exiting through the
            # interpreter would run hvdlite's shutdown and bury this error under "shut down" on the peers.
            os._exit(1)

    sys.excepthook = abort_job


def cpu_cores() -> tuple[int, int]:
    """(cores this process may run on, cores of the machine)."""
    total = os.cpu_count() or 1
    try:
        return len(os.sched_getaffinity(0)), total
    except (AttributeError, OSError):  # not on Linux
        return total, total


def gradient_overlap(compute_threads: Optional[int]) -> bool:
    """Whether a frontend should start gradient reductions during backward (see Config.gradient_overlap).

    ``compute_threads`` is how many CPU threads this rank's backward pass uses, or None when it runs
    on an accelerator (the CPU then has time for the engine). "auto" overlaps when every rank on the
    node can have a core for its engine besides its compute threads.
    """
    current = state()
    setting = current.config.gradient_overlap
    if setting != "auto":
        return setting == "on"
    if compute_threads is None:
        return True
    mine, machine = cpu_cores()
    sharing = current.local_size if mine == machine else 1  # unbound ranks share the node's cores
    return mine >= sharing * (compute_threads + 1)


def stage_host_copies() -> bool:
    """Whether frontends stage CPU tensors through a host copy like device tensors (a testing switch, see
    Config.stage_host_copies); False before init()."""
    current = _state
    return current is not None and current.config.stage_host_copies


def state() -> State:
    """The live runtime state, or an error that says to call init() first."""
    current = _state
    if current is None:
        raise NotInitializedError("hvdlite is not initialized: call hvd.init() first (after a shutdown(), "
                                  "call init() again)")
    return current


def is_initialized() -> bool:
    return _state is not None


def rank() -> int:
    return state().rank


def size() -> int:
    return state().size


def local_rank() -> int:
    return state().local_rank


def local_size() -> int:
    return state().local_size


def cross_rank() -> int:
    return state().cross_rank


def cross_size() -> int:
    return state().cross_size


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return state().homogeneous


def mpi_threads_supported() -> bool:
    return state().thread_level >= state().MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0 writes it)."""
    st = state()
    if st.rank == 0:
        st.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    st = state()
    st.timeline.stop()


def engine_stats() -> dict[str, int]:
    """Counters of the engine: negotiation cycles, full rounds, MPI data calls."""
    return state().engine.stats()
