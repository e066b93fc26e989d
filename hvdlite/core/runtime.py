"""The MPI runtime: init(), shutdown(), topology (rank, local_rank, cross_rank...) and build flags."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import log
from .config import Config
from .diagnostics import callsite
from .engine import mpi, polling
from .engine.autotune import require_library
from .engine.handles import Handle
from .engine.loop import Engine
from .engine.psets import Registry
from .engine.requests import Kind, Request, make_signature, tensor_layout
from .engine.timeline import Timeline
from .errors import NotInitializedError
from .launch_check import check_launch
from .log import logger
from .names import Names
from .process_sets import ProcessSet, normalize_ranks
from .reduce_ops import ReduceOp


class State:
    """Everything that exists between init() and shutdown(): communicators, engine, names, process sets."""

    def __init__(self, world: Any, config: Config) -> None:
        self.config = config
        self.world = world
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self.local_comm = mpi.split_shared(world, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = world.Split(self.local_rank, key=self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        node_sizes = self.cross_comm.allgather(self.local_size) if self.local_rank == 0 else None
        self.homogeneous = len(set(self.local_comm.bcast(node_sizes, root=0))) == 1
        self.engine_comm = world.Dup()
        self.presence_comm = world.Dup()
        self.thread_multiple = mpi.thread_multiple()
        self.mpi_ops = mpi.MPIOps()
        self.names = Names()
        callsite.forget_all()
        self.timeline = Timeline()
        self.psets = Registry(self.engine_comm, self.rank, self.size)
        polling.share_cores(*core_sharing(self.local_size))
        self.engine = Engine(self.engine_comm, self.mpi_ops, config, self.timeline, self.psets,
                             self.presence_comm)

    def close(self) -> None:
        self.engine.stop()
        self.timeline.stop()
        if not self.engine.alive:
            self.engine.executor.adasum_levels.free()
            self.psets.free()
            self.mpi_ops.free()
            for comm in (self.presence_comm, self.engine_comm, self.cross_comm, self.local_comm, self.world):
                comm.Free()

    def submit(self, kind: Kind, name: str, ps_id: int, inputs: list[np.ndarray], dtypes: list[str],
               outputs: Optional[list[Optional[np.ndarray]]] = None, op: Optional[ReduceOp] = None,
               prescale: float = 1.0, postscale: float = 1.0, root: int = 0, splits: Any = None,
               extra: Any = None, shape_of: Callable[[np.ndarray], tuple] = lambda a: tuple(a.shape),
               finalize: Optional[Callable[[Any], Any]] = None) -> Handle:
        """Hand one named request to the engine; the handle completes when every member has run it."""
        shapes = tensor_layout(dtypes[0], shape_of(inputs[0])) if len(inputs) == 1 else \
            tuple([(d, shape_of(a)) for a, d in zip(inputs, dtypes)])
        sig = make_signature(kind, ps_id, op, prescale, postscale, root, shapes, extra)
        req = Request(name, sig, inputs, outputs if outputs is not None else (None,) * len(inputs), dtypes,
                      op=op, splits=splits, finalize=finalize)
        if callsite.known.get(name) is not sig:  # a new name or signature: steady state skips the capture
            req.site = callsite.note(name, sig)
        self.engine.submit(req)
        return req

    def add_process_set(self, process_set: Any) -> ProcessSet:
        """Register a process set on every rank (all ranks call this, in the same order)."""
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.mpi_comm is not None and ps.ranks is None:
            ps.ranks = self._agreed_comm_ranks(ps)
        ranks = normalize_ranks(ps)
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"add_process_set: ranks {bad} do not exist in a job of {self.size} ranks")
        if self.psets.find(ranks) is not None:
            raise ValueError(f"add_process_set: a process set with ranks {ranks} is already registered")
        name = self.names.name("add_process_set", None)
        ps_id = self.submit(Kind.ADD_PROCESS_SET, name, 0, [], [], extra=tuple(ranks)).wait()
        return self.psets.register(ps, int(ps_id))

    def _agreed_comm_ranks(self, ps: ProcessSet) -> list[int]:
        """The ranks of a communicator-built set, as its members see them (non-members hold COMM_NULL).
        Exchanged on the world communicator (not the engine's), like the other set-up at registration."""
        views = self.world.allgather(mpi.communicator_world_ranks(ps.mpi_comm, self.world))
        members = {tuple(v) for v in views if v is not None}
        if len(members) != 1:
            detail = "no rank is a member" if not members else \
                "; ".join(f"rank {r}: {v}" for r, v in enumerate(views) if v is not None)
            raise ValueError(f"add_process_set(ProcessSet(comm)): the communicators disagree ({detail}); every "
                             f"member must pass the same communicator (non-members MPI.COMM_NULL), one "
                             f"ProcessSet per communicator")
        return list(members.pop())

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Unregister a process set on every rank (all ranks call this). True if it was registered."""
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id == 0 or ps_id not in self.psets.ranks:
            return False
        name = self.names.name("remove_process_set", None)
        self.submit(Kind.REMOVE_PROCESS_SET, name, 0, [], [], extra=int(ps_id)).wait()
        return True


_state: Optional[State] = None
_lock = threading.RLock()
_atexit_registered = False
_previous_excepthook: Any = None
_previous_threading_hook: Any = None
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
        if config.autotune:
            require_library()
        log.set_level(config.log_level)
        log.set_timestamps(not config.log_hide_time)
        mpi.start()
        world = mpi.make_world(comm)
        log.set_rank(world.Get_rank())
        check_launch(mpi.world_size())  # the job as launched, not a sub-world from comm=
        # Agreement: one value per job for every setting that shapes MPI traffic (before the engine starts).
        for warning in config.adopt(world.bcast(config.agreed_values(), root=0), world.Get_rank()):
            logger.warning(warning)
        state = State(world, config)
        _state = state
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        if config.abort_on_error:
            _install_excepthook()
        if config.timeline_at_init() and state.rank == 0:
            state.timeline.start(config.timeline_at_init(), config.timeline_mark_cycles)
    for ps in process_sets or ():
        state.add_process_set(ps)


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
    """On an uncaught exception in any thread, print it, then abort the whole job (other ranks would
    otherwise wait for this one forever). Hooks installed before hvdlite's (not Python's defaults) run
    first, so a script's own error reporting still happens."""
    global _previous_excepthook, _previous_threading_hook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook
    _previous_threading_hook = threading.excepthook

    def abort_job(exc_type: Any, exc: BaseException, tb: Any, thread: str = "") -> None:
        state = _state
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        where = f" in thread {thread}" if thread else ""
        sys.stderr.write(f"[hvdlite rank {state.rank if state else '?'}] uncaught exception{where}; aborting "
                         f"the whole job so other ranks do not wait for this one:\n{text}")
        sys.stderr.flush()
        if state is not None and state.size > 1 and not issubclass(exc_type, KeyboardInterrupt):
            # The launcher forwards this rank's output and its abort request on separate channels; when
            # the abort wins, the traceback above can be lost. Give the output a moment to get through.
            time.sleep(_ABORT_GRACE_S)
            mpi.abort(1)
            # MPICH's MPI_Abort can return while the launcher tears the job down; exiting through the
            # interpreter would run hvdlite's shutdown and bury this error under "shut down" on the peers.
            os._exit(1)

    def main_thread_hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        if _previous_excepthook not in (None, sys.__excepthook__):
            _previous_excepthook(exc_type, exc, tb)
        abort_job(exc_type, exc, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        if _previous_threading_hook not in (None, threading.__excepthook__):
            _previous_threading_hook(args)
        abort_job(args.exc_type, args.exc_value, args.exc_traceback,
                  args.thread.name if args.thread is not None else "?")

    sys.excepthook = main_thread_hook
    threading.excepthook = thread_hook


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


def local_overlap_verdict(compute_threads: Optional[int]) -> bool:
    """This rank's own view of gradient_overlap=auto (see gradient_overlap(), which agrees on it).

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
    sharing, mine = core_sharing(current.local_size)
    return mine >= sharing * (compute_threads + 1)


def gradient_overlap(compute_threads: Optional[int], process_set: Optional[ProcessSet] = None) -> bool:
    """Whether a frontend starts gradient reductions during backward (see Config.gradient_overlap),
    decided once for the process set: every member calls this (when building its optimizer), and the
    set overlaps only if every member's own view says so, so all issue the same sequence of collectives."""
    current = state()
    verdict = local_overlap_verdict(compute_threads)
    if current.config.gradient_overlap != "auto":
        return verdict  # the setting itself is agreed at init()
    ps = process_set if process_set is not None else current.psets.sets[0]
    ps_id = ps.process_set_id or 0
    name = current.names.name("gradient_overlap.agreement", None, ps_id)
    handle = current.submit(Kind.ALLREDUCE, name, ps_id, [np.array([int(verdict)], dtype=np.int32)],
                            ["int32"], op=ReduceOp.MIN)
    return bool(handle.wait()[0][0])


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
    return state().thread_multiple


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


def straggler_report() -> dict[str, Any]:
    """Per rank, how late it submitted the ops of the last complete window of ``straggler_window_ops`` agreed
    ops: mean and p95 milliseconds after the first rank, and the share of ops it submitted last; plus the
    rank named as the straggler (or None). The same dict on every rank; zeros before the first window."""
    return state().engine.stragglers.report()
