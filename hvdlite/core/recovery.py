"""In-process recovery from a lost rank (ULFM): shrink the job to its survivors and rebuild the runtime on them."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import Optional

from . import api, errors, log, runtime
from .engine import mpi
from .fencing import Peer, fence
from .errors import HvdliteError, ProcessFailedError
from .log import logger
from .process_sets import ProcessSet

#: Seconds MPI_Finalize may take at the exit of a rank of a fault-tolerant job, before it exits without it.
FINALIZE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What one recovery did: the processes of the lost ranks, and the size after it."""

    lost_peers: tuple[Peer, ...]
    new_size: int


def lost_rank(exc: BaseException) -> Optional[ProcessFailedError]:
    """errors.lost_rank of ``exc`` and of the error the running engine ended with."""
    return errors.lost_rank(exc, runtime.state().engine.error if runtime.is_initialized() else None)


def can_recover(error: BaseException) -> bool:
    """Whether ``error`` is a lost rank this job can recover from in-process (ULFM on, elastic_mode allows it)."""
    if not isinstance(error, ProcessFailedError) or not runtime.is_initialized():
        return False
    state = runtime.state()
    return state.fault_tolerant and state.config.elastic_mode != "restart"


class LostBeforeTheEnd(ProcessFailedError):
    """finish_together()'s lost rank: this rank has taken part in the agreement with which recover() starts."""


def finish_together() -> None:
    """After hvd.elastic.run's function returned, in a fault-tolerant job: agree with every rank that none was lost,
    so that all finish or all recover (docs/elastic.md, "The end of a run")."""
    state = runtime.state()
    if not state.fault_tolerant or mpi.agree(state.world):
        return
    raise LostBeforeTheEnd(f"rank {state.rank}: rank(s) {mpi.failed_ranks(state.world)} of this job died before every "
                           f"rank had finished; hvd.elastic.run recovers on the survivors", seen_at=time.time())


def recover(error: Optional[ProcessFailedError] = None) -> Recovery:
    """Collective over the survivors after their collectives failed with ``error``: shrink the job's communicator,
    build a new State on them, and register the process sets again on their surviving members (or unregister)."""
    started = time.monotonic()
    agreed = isinstance(error, LostBeforeTheEnd)  # (its engine, still running, ends in abandon() on the lost rank)
    with runtime._lock:
        old = runtime.state()
        if not old.fault_tolerant:
            raise HvdliteError(f"rank {old.rank}: cannot recover from a lost rank in this process: "
                               f"{old.fault_tolerance_reason}")
        old.abandon()
        world, old_ranks = old.world, list(range(old.size))
        while True:  # a rank lost while the runtime is rebuilt: shrink again
            world, kept = mpi.shrink(world, agreed and world is old.world)  # (agreed: in the first one only)
            old_ranks = [old_ranks[r] for r in kept]
            log.set_rank(world.Get_rank())
            try:
                new = runtime.State(world, old.config)
                break
            except Exception as exc:  # noqa: BLE001 - only a lost peer is retried
                if not mpi.is_process_failure(exc):
                    raise
                logger.warning("another rank was lost while recovering (%s): shrinking again", exc)
        lost = tuple(r for r in range(old.size) if r not in old_ranks)
        runtime._state = new
    _rebuild_process_sets(old.psets.sets, old_ranks, new)
    # end a stopped rank ULFM declared failed only once every survivor has built every communicator (its death,
    api.barrier()  # news to Open MPI, segfaults one still building: docs/elastic.md, "A second rank lost ...")
    fence(lost, old.peers, "was declared failed but its process is still there",
          "so that it cannot hold the job's end or come back")
    hosts = ", ".join(old.hosts[r] for r in lost) or "-"
    logger.warning("recovered from the loss of rank(s) %s (host(s) %s) in %.3f s: %d ranks now; this rank was "
                   "%d, is %d (the failure was seen here at t=%.6f)", list(lost), hosts, time.monotonic() - started,
                   new.size, old.rank, new.rank, error.seen_at if error is not None else 0.0)
    return Recovery(tuple(old.peers[r] for r in lost), new.size)


def _rebuild_process_sets(sets: dict[int, ProcessSet], old_ranks: list[int], state: "runtime.State") -> None:
    """Register every process set again, in the old order, on its surviving members (the program's ProcessSet
    objects stay valid). Collective on every survivor."""
    new_rank_of = {old: new for new, old in enumerate(old_ranks)}
    for ps_id, ps in sorted(sets.items()):
        if ps_id == 0:
            continue
        before = list(ps.ranks or ())
        after = [new_rank_of[r] for r in before if r in new_rank_of]
        ps.process_set_id, ps.mpi_comm = None, None
        if not after:
            logger.warning("process set %s lost every member: it is unregistered", before)
            continue
        existing: Optional[int] = state.psets.find(after)
        if existing == 0:  # every survivor: it becomes the global set
            ps.ranks, ps.process_set_id, ps._my_rank = list(range(state.size)), 0, state.rank
        elif existing is not None:  # the same members as another set: it becomes that set
            state.psets.register(ps, existing)
        else:
            ps.ranks = after
            state.add_process_set(ps)


def finalize_at_exit(timeout_s: float) -> None:
    """At the exit of a fault-tolerant job's rank (hvd.elastic.run registers it): shut down and end MPI within
    ``timeout_s``, else exit without MPI_Finalize (status 1 after an uncaught exception)."""
    try:
        runtime.shutdown()
    except Exception:  # noqa: BLE001 - never keep the process from ending
        logger.debug("shutdown at exit failed", exc_info=True)

    def give_up() -> None:
        status = 1 if getattr(sys, "last_value", None) is not None else 0
        logger.error("MPI_Finalize has not returned within %g s (Open MPI's fault-tolerant MPI_Finalize waits for "
                     "every other rank, and for the dead ranks in its closing PMIx fence unless launched with --mca "
                     "async_mpi_finalize true, as hvdlite-run does): exiting without it, status %d", timeout_s, status)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)

    limit = threading.Timer(timeout_s, give_up)
    limit.daemon = True
    limit.start()
    mpi.finalize()
    limit.cancel()
