"""``elastic.run``: the wrapper around an elastic training function (sync at start, resize on host changes)."""
from __future__ import annotations

import atexit
import functools
import gc
import sys
from typing import Any, Callable, TypeVar

from .. import recovery, runtime
from ..elastic_wire import MIN_NP_VARIABLE
from ..horovod_forms import allreduce
from ..log import logger
from ..reduce_ops import Min
from . import link as driver
from .state import HostsUpdatedInterrupt, State

F = TypeVar("F", bound=Callable[..., Any])

#: Exit code of a rank that leaves because the job is resizing (the driver is also told by message).
RESIZE_EXIT_CODE = 75


def run(func: F) -> F:
    """Decorate ``func(state, *args, **kwargs)`` for elastic training (Horovod's ``hvd.elastic.run``; docs/elastic.md):
    sync the state at every start, resize on a host change, recover from a lost rank."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        lk = driver.link()
        lk.connect(runtime.rank(), runtime.size())
        if runtime.state().fault_tolerant:  # at exit, MPI_Finalize within its limit (recovered or not), once
            atexit.unregister(recovery.finalize_at_exit)
            atexit.register(recovery.finalize_at_exit, recovery.FINALIZE_TIMEOUT_S)
        try:
            result = _run_recovering(func, state, args, kwargs)
        except HostsUpdatedInterrupt:
            logger.info("hosts changed: leaving at commit %d so the job restarts at its new size",
                        state.commit_counter)
            _leave(state)
        lk.send(op="done")
        state.finish()
        return result

    return wrapper  # type: ignore[return-value]


def _run_recovering(func: Callable[..., Any], state: State, args: Any, kwargs: Any) -> Any:
    """Sync the state (after a restart, then run the reset callbacks), and call ``func`` until it returns; after a
    lost rank (where the MPI allows it) recover, restore the last commit, run the reset callbacks and call again."""
    synced, reset, error = False, driver.link().restart > 0, None
    while True:
        try:
            if error is not None:
                done = recovery.recover(error)
                driver.link().send(op="recovered", size=done.new_size,
                                   lost_peers=[[p.host, p.pid, p.started] for p in done.lost_peers])
                _leave_below_min_np(state, done.new_size)
                # whether every survivor had finished its first sync: all then take the same path (some in the sync,
                # some past it, they met different collectives and hung: docs/elastic.md, "After a recovery")
                synced = bool(allreduce([int(synced)], name="hvdlite.elastic.synced", op=Min)[0])
                reset, error = True, None
                state.restore()  # not all synced: rank 0 sends, with no commit, the state it synced to (or has)
                if synced:
                    state.on_reset()
                    state.sync(in_memory=True)
            if not synced:
                state.sync()
                synced = True
                if reset:
                    logger.info("running the reset callbacks at size %d", runtime.size())
                    state.on_reset()
            result = func(state, *args, **kwargs)
            recovery.finish_together()
            return result
        except Exception as exc:  # noqa: BLE001 - a lost rank, possibly wrapped by the framework (TensorFlow)
            error = recovery.lost_rank(exc)
            if error is None:
                raise
            if not recovery.can_recover(error):
                raise error


def _leave_below_min_np(state: State, size: int) -> None:
    """Survivors fewer than hvdlite-run's --min-np leave, for the driver to restart the job from its last commit."""
    min_np = driver.number(MIN_NP_VARIABLE)
    if size >= min_np or not driver.link().enabled:
        return
    logger.warning("%d rank(s) left, below --min-np %d: leaving at commit %d without training on; hvdlite-run "
                   "starts the job again from it once %d slots are usable", size, min_np, state.commit_counter, min_np)
    state.keep(if_newer=True)  # (the host's writer of the last commit may have died before writing it)
    _leave(state)


def _leave(state: State) -> None:
    """End this process for the driver to start the job again from the last commit (at the size it then has)."""
    driver.link().send(op="resize", commit=state.commit_counter)
    runtime.shutdown()
    driver.link().close()
    gc.freeze()  # the interpreter's last collections skip what is alive now: exiting took 1 s, not 4-6 s (load 18)
    sys.exit(RESIZE_EXIT_CODE)
