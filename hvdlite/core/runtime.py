"""The MPI runtime's state and lifecycle: init(), shutdown(), state(), and the topology (rank, ..., cores)."""
from __future__ import annotations

import atexit
import itertools
import os
import threading
from typing import Any, Optional, Sequence

from . import log
from .abort import install_excepthook
from .config import Config, mpi_ft_launched
from .engine import mpi, polling
from .fencing import Peer, fence, fence_elsewhere, this_process
from .engine.autotune import require_library
from .engine.loop import Engine
from .engine.names import Names
from .engine.psets import Registry
from .engine.requests import Kind
from .engine.timeline import Timeline
from .errors import NotInitializedError, ShutdownError
from .launch_check import (OPENMPI_IALLREDUCE_VARIABLE, check_launch, check_launcher_before_init,
                           check_same_iallreduce, launched_by_open_mpi, openmpi_iallreduce)
from .log import logger
from .engine.planes import PlaneTable
from .process_sets import ProcessSet, plan, refusals
from .submission import submit


class State:
    """Everything that exists between init() and shutdown(): communicators, engine, names, process sets."""

    def __init__(self, world: Any, config: Config) -> None:
        self.config = config
        self.world = world
        # ULFM: a lost peer fails the survivors' calls (MPI_ERR_PROC_FAILED) instead of aborting them; the
        # communicators made from this one below inherit the setting.
        self.fault_tolerant, self.fault_tolerance_reason = mpi.fault_tolerance(mpi_ft_launched())
        if self.fault_tolerant:
            mpi.errors_return(world)
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        self.local_comm = mpi.split_shared(world, key=self.rank)
        self.local_rank: int = self.local_comm.Get_rank()
        self.local_size: int = self.local_comm.Get_size()
        self.cross_comm = world.Split(self.local_rank, key=self.rank)
        self.cross_rank: int = self.cross_comm.Get_rank()
        self.cross_size: int = self.cross_comm.Get_size()
        node_sizes = self.cross_comm.allgather(self.local_size) if self.local_rank == 0 else None
        self.homogeneous = len(set(self.local_comm.bcast(node_sizes, root=0))) == 1
        self.peers: list[Peer] = world.allgather(this_process())  # to name a lost rank's host, and to fence it
        self.hosts: list[str] = [peer.host for peer in self.peers]
        self.engine_comm = world.Dup()
        self.presence_comm = world.Dup()
        self.thread_multiple = mpi.thread_multiple()
        self.mpi_ops = mpi.MPIOps()
        self.names = Names()
        #: The process sets init(process_sets=...) registered; None while that list failed (then the next
        #: init() registers its own list, as Horovod asks for "a valid list of process sets to proceed").
        self.init_sets: Optional[list[ProcessSet]] = []
        self.memo: dict[Any, Any] = {}  # what submission.submit worked out per name (or per unnamed kind)
        self.generation = next(_GENERATIONS)  # frontends' per-tensor caches are valid for one generation
        self.timeline = Timeline()
        self.psets = Registry(self.engine_comm, self.rank, self.size)
        polling.share_cores(*core_sharing(self.local_size))
        self.planes = PlaneTable(config, world, self.rank, self.local_size == self.size)
        self.planes.make_for_set(0, self.engine_comm)
        self.engine = Engine(self.engine_comm, self.mpi_ops, config, self.timeline, self.psets,
                             self.presence_comm, names=self.names, planes=self.planes, hosts=self.hosts,
                             fence=self.fence_silent if self.fault_tolerant else None)

    def fence_silent(self, ranks: list[int]) -> list[int]:
        """A fault-tolerant job's long wait: kill this host's stopped ranks; have ``ranks`` (silent) ended elsewhere."""
        killed = fence(range(self.size), self.peers, "is stopped (SIGSTOP) while the others wait for it",
                       "so that MPI sees it as failed and the survivors recover without it", stopped_only=True)
        fence_elsewhere(ranks, self.peers, f"answered no probes for {self.config.stall_shutdown_time_seconds:g} s "
                        f"(stall_shutdown_time_seconds; stopped or wedged)")
        return killed

    def abandon(self) -> None:
        """Leave this state after a lost rank: only the local parts are released (freeing the revoked
        communicators would be a collective with the dead)."""
        self.engine.stop(timeout=5.0)
        self.timeline.stop()
        self.planes.close(clean=False)
        self.mpi_ops.free()

    def close(self) -> None:
        self.engine.stop()
        self.timeline.stop()
        if not self.engine.alive:
            # after a failure (a peer gone or wedged) closing must not wait for the peers
            self.planes.close(clean=self.engine.error is None or isinstance(self.engine.error, ShutdownError))
            self.engine.executor.adasum_levels.free()
            self.psets.free()
            self.mpi_ops.free()
            for comm in (self.presence_comm, self.engine_comm, self.cross_comm, self.local_comm, self.world):
                comm.Free()

    def add_process_set(self, process_set: Any) -> ProcessSet:
        """Register a process set on every rank (all call this, in the same order; a comm: see process_sets.py)."""
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        return self.register_sets([ps], set(self.psets.ranks), ps.mpi_comm is not None)[0]

    def register_sets(self, sets: Sequence[ProcessSet], known_before: set[int], gather: bool) -> list[ProcessSet]:
        """Register ``sets`` on every rank (collective; see process_sets.py); ValueError for those this rank refuses."""
        planned = plan(sets, self.world, self.rank, self.size, gather)
        for ranks in planned.lists:
            if self.psets.find(ranks) is None:
                submit(self, Kind.ADD_PROCESS_SET, None, 0, (), (), (), (), extra=tuple(ranks)).wait()
        ids = [None if ranks is None else self.psets.find(ranks) for ranks in planned.mine]
        refused = refusals(sets, planned.mine, ids, known_before, self.rank)
        for ps, ps_id, why in zip(sets, ids, refused):
            if why is None and ps_id is not None:
                self.psets.register(ps, ps_id)
        if any(refused):
            raise ValueError(f"process sets refused on rank {self.rank}: {'; '.join(filter(None, refused))}")
        return list(sets)

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Unregister a process set on every rank (all ranks call this). True if it was registered."""
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id == 0 or ps_id not in self.psets.ranks:
            return False
        submit(self, Kind.REMOVE_PROCESS_SET, None, 0, (), (), (), (), extra=int(ps_id)).wait()
        return True


_state: Optional[State] = None
_GENERATIONS = itertools.count(1)
_lock = threading.RLock()


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet] | str] = None, **settings: Any) -> None:
    """Start hvdlite: bring up MPI, work out the topology and start the engine thread. ``comm``: an mpi4py
    communicator or a list of ranks of MPI_COMM_WORLD; other keywords override settings (``Config``). Again
    while up, it starts afresh only after the engine ended with an error (which ends it on every rank), and
    registers ``process_sets`` if given (or if the last list was refused), on every rank."""
    global _state
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSets, or 'dynamic' "
                             f"(hvdlite always allows add_process_set() later)")
        process_sets = None
    with _lock:
        state = _state
        if state is not None and state.engine.error is None:
            if state.init_sets is not None and not process_sets:
                return
        else:
            if state is not None:  # the engine's error ended it on every rank in the same round
                _state = None
                state.close()
            state = _start(comm, settings)
    state.init_sets = None  # while a refused list raises ValueError here, the others' sets registered
    state.init_sets = state.register_sets(list(process_sets), set(), True) if process_sets else []


def _start(comm: Any, settings: dict[str, Any]) -> State:
    """A fresh State (MPI up, settings agreed, engine started) as the current one; called with _lock held."""
    global _state
    config = Config.from_env(**settings)
    if config.autotune:
        require_library()
    log.set_level(config.log_level)
    log.set_timestamps(not config.log_hide_time)
    with openmpi_iallreduce(Config.OPENMPI_IALLREDUCE_ALGORITHMS[config.openmpi_iallreduce_algorithm],
                            mpi.started()) as iallreduce:
        # Under Open MPI's launcher an MPICH library dies inside its own MPI_Init: look before starting.
        mpi.start(check_launcher_before_init if launched_by_open_mpi() else None)
    world = mpi.make_world(comm)
    log.set_rank(world.Get_rank())
    check_launch(mpi.world_size())  # the job as launched, not a sub-world from comm=
    check_same_iallreduce(world, mpi.library_version(), iallreduce)
    logger.debug("MPI started with %s=%s", OPENMPI_IALLREDUCE_VARIABLE,
                 "(started before hvd.init())" if iallreduce is None else iallreduce or "(unset)")
    config.agree(world)  # one value per job for every setting that shapes MPI traffic
    state = State(world, config)
    _state = state
    atexit.unregister(_shutdown_at_exit)  # once
    atexit.register(_shutdown_at_exit)
    if config.abort_on_error:
        install_excepthook(lambda: _state)
    if config.timeline_at_init() and state.rank == 0:
        state.timeline.start(config.timeline_at_init(), config.timeline_mark_cycles)
    return state


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


def generation() -> int:
    """A number that changes with every init(): what a frontend caches per tensor is valid within one."""
    return state().generation


def state() -> State:
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
    return state().thread_multiple


def cpu_cores() -> tuple[int, int]:
    """(cores this process may run on, cores of the machine)."""
    total = os.cpu_count() or 1
    try:
        return len(os.sched_getaffinity(0)), total
    except (AttributeError, OSError):  # not on Linux
        return total, total


def core_sharing(local_size: int) -> tuple[int, int]:
    """(ranks that share this rank's cores, those cores): unbound ranks share the whole node's cores."""
    mine, machine = cpu_cores()
    return (local_size if mine == machine else 1), mine
