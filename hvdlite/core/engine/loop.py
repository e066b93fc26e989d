"""The engine loop: the one thread per process that negotiates, fuses and runs every collective."""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np

from ..config import Config
from ..errors import DuplicateNameError, HvdliteError, ProcessFailedError, ShutdownError, StallError
from ..log import logger
from . import mpi, negotiation, polling
from .completion import Completion
from .execution import Executor
from .mpi import MPIOps
from .names import Names
from .negotiation import (FLAG_BUSY, FLAG_EXPLAIN, FLAG_FULL, FLAG_SHUTDOWN, JOIN_TOLERANT, JOIN_TOLERANT_PERMISSIVE,
                          pending_flags)
from .cache import ResponseCache
from .chunks import start_allreduce
from .observers import CycleObserver
from .psets import Registry, Scope
from .requests import Kind, Request
from .stalls import Presence, Stop, Watchdog, Wedged
from .timeline import Timeline, negotiate_activity


#: Seconds a survivor waits for its failure detector to name the lost ranks before it fails the handles.
LOST_RANKS_WAIT_S = 2.0


class Engine:
    """Owns the engine communicator; user threads only ``submit()`` requests and wait on handles. Its
    ``completion`` holds the pending requests and ends each one (engine/completion.py)."""

    def __init__(self, comm: Any, mpi_ops: MPIOps, config: Config, timeline: Timeline,
                 process_sets: Registry, presence_comm: Any,
                 names: Optional[Names] = None, planes: Any = None,
                 hosts: Optional[list[str]] = None,
                 fence: Optional[Callable[[list[int]], list[int]]] = None, scope: Optional[int] = None,
                 parent: Optional[Engine] = None) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.hosts = hosts or []  # each rank's host, to name a lost rank's
        self.rank = process_sets.world_rank  # the job's rank (also in a partial set's own engine)
        self.scope = Scope(process_sets, scope)  # the whole job, or one partial set's members (see _set_changed)
        if scope is not None:  # straggler windows and autotune's agreement are the whole job's
            config = dataclasses.replace(config, straggler_window_ops=0, autotune=False)
        self.config = config
        self.timeline = timeline
        self.psets = process_sets
        self.mpi_ops = mpi_ops
        self.cache = ResponseCache(config.cache_capacity, self.rank)
        self.presence = Presence(presence_comm, mpi_ops)
        self.executor = Executor(mpi_ops, process_sets, config, timeline, planes)
        self._lock = threading.Lock()  # a plain lock: submit() takes it only to wake a sleeping engine
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[Request] = collections.deque()
        self.completion = Completion(self.rank, comm, process_sets, self.cache, self.executor, timeline, names,
                                     keep_times=config.straggler_window_ops > 0)
        self.names = names
        self._shutdown_requested = False
        self._sleeping = False  # the engine waits on _cv: a submission must notify it
        self.error: Optional[BaseException] = None
        self.cycles = 0
        self.full_cycles = 0        # rounds that agreed more than cache bits: votes and explaining rounds
        self.explain_cycles = 0     # explaining rounds: every rank's message allgathered (negotiation.decide)
        self.bitvector_bytes = 0    # bytes each rank contributed to the per-cycle bit-vector all-reduces
        self.vote_bytes = 0         # bytes this rank received in votes (proposal sizes, proposals, the vote)
        self.full_path_bytes = 0    # bytes allgathered (every rank's message) on explaining rounds
        self.negotiation_calls = 0  # MPI collectives the rounds made (the data's are executor.mpi_calls)
        self.join_cycle = -1
        self.join_tolerant = JOIN_TOLERANT_PERMISSIVE if config.join_allows_allgather_broadcast else JOIN_TOLERANT
        self.watchdog = Watchdog(config, self.presence, self._waiting_names, fence)
        self.fault_tolerant = fence is not None  # (a fence is given exactly to fault-tolerant jobs: ULFM on)
        self._last_cycle = 0.0
        self._job_busy = False  # some rank had work in the last round
        self.busy_cycles = 0
        # the last round that agreed ops (or this rank's first op after none pending); the last round's end
        self._agreed_at = self._round_end = time.monotonic()
        self.observer = CycleObserver(config, self.rank, self.size, mpi_ops, timeline)
        self.set_engines: dict[int, Engine] = {}  # this rank's partial sets' own engines, by set
        self.parent = parent  # a partial set's engine: the whole job's
        self.recent_stalls: list[tuple[float, tuple[int, str]]] = []  # (when, key) this engine's last verdict failed
        process_sets.on_change = self._set_changed if scope is None else process_sets.on_change
        self._thread = threading.Thread(target=self._main, name="hvdlite-engine", daemon=True)
        self._thread.start()

    # -- user threads -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """The one way into the engine, for every request (each built by core/submission.submit). Lock-free: each
        step one atomic operation on a builtin; the lock only to wake a sleeping engine (marked before it looks)."""
        if self.set_engines and req.key[0] in self.set_engines:  # a partial set's: its members' engine
            return self.set_engines[req.key[0]].submit(req)
        if self.error is not None:
            raise self.error
        if self.completion.inflight.setdefault(req.key, req) is not req:
            raise DuplicateNameError(f"rank {self.rank}: a collective named {req.name!r} is already in flight; wait "
                                     f"for it with synchronize() before reusing the name, or give each op its own name")
        self._queue.append(req)
        if self.error is not None:  # the engine ended meanwhile and may have failed the queue before this append
            req.settle(error=self.error)
        elif self._sleeping:  # a busy engine takes the queue at its next cycle: no wake-up to pay for
            with self._cv:
                self._sleeping = False  # one wake-up is enough: later submissions before it runs need none
                self._cv.notify()

    def stop(self, timeout: float = 60.0, drain: bool = False) -> None:
        """Ask every rank's engine to stop (collectively; ``drain``: after its ops in flight) and wait for it."""
        for engine in list(self.set_engines.values()):
            engine.stop(timeout)
        while drain and self.completion.inflight and self.error is None and self._thread.is_alive():
            time.sleep(0.001)
        with self._cv:
            self._shutdown_requested = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine did not stop within %.0f s (another rank may be stuck in a "
                           "collective); exiting without it", timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        names = ("cycles", "full_cycles", "busy_cycles", "bitvector_bytes", "full_path_bytes", "explain_cycles",
                 "vote_bytes", "negotiation_calls")
        return {"mpi_calls": self.executor.mpi_calls, **{name: getattr(self, name) for name in names}}

    # -- engine thread --------------------------------------------------------------------------
    def _main(self) -> None:
        polling.set_watch(self.watchdog.watch)
        polling.fine_timer_slack()
        try:
            while self._wait_for_work():
                self._cycle()
        except Wedged as wedged:
            logger.error("%s", wedged)
            self._fail_everything(StallError(str(wedged)))
        except Stop as stop:
            self._fail_everything(ShutdownError(str(stop)))
        except Exception as exc:  # noqa: BLE001 - a lost peer (ULFM) first, any other failure below
            if not mpi.is_process_failure(exc) and not self._peer_died():
                self._failed(exc)
                return
            self._fail_everything(self._lost_peer(exc))
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting handle
            self._failed(exc)

    def _fail_everything(self, error: BaseException) -> None:
        """The engine ended: every pending and queued request, and every later submission, fails with ``error``."""
        with self._cv:
            self.error = error
            waiting = self.completion.take_all() + list(self._queue)
            self._queue.clear()
        self.observer.stragglers.quiet.set()  # an exchange it was in will not end: straggler_report() has the last one
        for req in waiting:
            req.settle(error=error)
        self.timeline.stop()

    def _failed(self, exc: BaseException) -> None:
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        logger.error("the engine failed:\n%s", detail)
        error = exc if isinstance(exc, HvdliteError) else HvdliteError(
            f"rank {self.rank}: the hvdlite engine failed with {type(exc).__name__}: {exc}. "
            f"Every pending and later collective raises this error; restart the job.")
        self._fail_everything(error)

    def _peer_died(self) -> bool:
        """After a failure that is not MPI's (e.g. a gloo plane lost a peer): whether, in a fault-tolerant job, MPI
        knows of a dead peer within LOST_RANKS_WAIT_S (then the survivors can recover from that loss)."""
        if not self.fault_tolerant:
            return False
        try:
            return bool(self._failed_ranks(self.presence.serve))  # (answering probes drives MPI's progress)
        except Exception as exc:  # noqa: BLE001 - only MPI's report of a lost peer counts
            return mpi.is_process_failure(exc)

    def _failed_ranks(self, progress: Callable[[], None]) -> list[int]:
        """The ranks MPI knows to have failed, after up to LOST_RANKS_WAIT_S of ``progress()`` (news of a death
        arrives only inside MPI calls: its failure detector names them within about a second)."""
        deadline = time.monotonic() + LOST_RANKS_WAIT_S
        lost = mpi.failed_ranks(self.comm)
        while not lost and time.monotonic() < deadline:
            progress()
            time.sleep(0.01)
            lost = mpi.failed_ranks(self.comm)
        return lost

    def _lost_peer(self, exc: BaseException) -> ProcessFailedError:
        """MPI reported a dead peer (ULFM): revoke the engine's communicators, so every survivor's calls fail at
        once, and name the lost ranks."""
        seen_at = time.time()
        for comm in (self.comm, self.presence.comm, *self.psets.comms.values()):
            if comm is not None:
                mpi.revoke(comm)
        lost = self._failed_ranks(mpi.progress)
        hosts = tuple(self.hosts[r] if r < len(self.hosts) else "?" for r in lost)
        who = ", ".join(f"rank {r} (host {h})" for r, h in zip(lost, hosts)) or "a rank (not yet known here)"
        message = (f"rank {self.rank}: {who} of this job died ({exc}); every pending and later collective "
                   f"fails. hvd.elastic.run recovers in this process on the survivors; elsewhere restart the job.")
        logger.error("%s", message)
        return ProcessFailedError(message, tuple(lost), hosts, seen_at)

    def _wait_for_work(self) -> bool:
        """Sleep while there is nothing to do; return when a cycle should run (docs/ARCHITECTURE.md, step 3: with
        nothing pending, until this rank's submission, then on a crowded node the rest of its burst; with ops pending
        and no round agreeing any, paced by polling.stalled_pause). ``longest``: the others' rounds find it by then."""
        cycle_s = self.config.cycle_time_ms / 1000.0
        longest = min(self.config.idle_heartbeat_seconds, max(cycle_s, self.watchdog.period / 4))
        with self._cv:
            if self.completion.pending:  # left over: pace cycles so waiting for peers does not spin
                delay = max(self._last_cycle + cycle_s, self._round_end + polling.stalled_pause(
                    self._round_end - self._agreed_at)) - time.monotonic()
                if delay > 0:
                    self._sleep(delay)
                return True
            self._sleep(longest if self.observer.stragglers.quiet.is_set() else cycle_s)  # (an exchange: cycles end it)
        if polling.CROWDED and self._queue:
            polling.wait(polling.Polled(polling.Burst(self._queue, longest).over), cap=0.001)
        return True

    def _set_changed(self, kind: Kind, ps_id: int) -> None:
        """A partial set's members start its own engine when it is added and stop it, after its ops, when removed."""
        psets = self.psets
        if kind is Kind.ADD_PROCESS_SET and psets.partial(ps_id) and psets.is_member(ps_id):
            self.set_engines[ps_id] = Engine(psets.comms[ps_id], self.mpi_ops, self.config, self.timeline, psets,
                                              psets.comms[ps_id], self.names, self.executor.planes, self.hosts,
                                              scope=ps_id, parent=self)  # (its comm's probes: its thread's only)
        elif kind is Kind.REMOVE_PROCESS_SET and ps_id in self.set_engines:
            self.set_engines.pop(ps_id).stop(drain=True)  # the set's ops submitted before its removal run first

    def _move_names(self, names: Names, new: list[Request]) -> None:
        """Rename the submissions that took a generated name before this rank read a stall verdict that
        failed it (engine/names.py, Names.learn), as the other ranks name the same ops. Under the lock."""
        inflight = self.completion.inflight
        for req in new:
            ps_id = req.key[0]
            moved = names.moved(req.name, ps_id)
            if moved is not None and inflight.setdefault((ps_id, moved), req) is req:  # (atomic: submit() takes none)
                inflight.pop(req.key, None)
                req.name, req.key = moved, (ps_id, moved)

    def _sleep(self, seconds: float) -> None:
        """Wait on the condition (lock held) until a submission, a stop or the timeout (marked first: see submit())."""
        self._sleeping = True
        if not (self._queue or self._shutdown_requested):
            self._cv.wait(seconds)
        self._sleeping = False

    def _cycle(self) -> None:
        self._last_cycle = time.monotonic()
        self.cycles += 1
        with self._cv:
            queue = self._queue
            new = [queue.popleft() for _ in range(len(queue))]  # (not list() and clear(): submit() takes no lock)
            shutdown = self._shutdown_requested and self.observer.stragglers.quiet.is_set()  # (an exchange ends first)
            if self.names is not None and self.names.moving:
                self._move_names(self.names, new)
        tracing = self.timeline.enabled
        pending, bits = self.completion.pending, self.completion.bits
        if new and not pending:  # its waits for peers count from here, not from the last op before an idle spell
            self._agreed_at = self._last_cycle
        pending.update([(req.key, req) for req in new])
        for req in new if tracing else ():
            self.timeline.begin(req.name, negotiate_activity(req.sig.kind, req.sig.op), kind=req.sig.kind.label)
        self.timeline.cycle(self.cycles)

        flags = FLAG_SHUTDOWN | FLAG_EXPLAIN if shutdown else 0
        cache = self.cache
        mine = bits.add(new, pending)
        joined = self.completion.joined
        if bits.uncached or joined:  # (a join is never cached)
            flags |= pending_flags(pending, self.scope.agrees, joined, self.join_tolerant)
            if any(req.sig.kind is Kind.JOIN for req in new):
                self.join_cycle = self.cycles
        if self.watchdog.check_due(pending.values()) or self.join_cycle == self.cycles:
            flags |= FLAG_EXPLAIN
        if pending:
            flags |= FLAG_BUSY
        flags |= self.observer.flags(self._last_cycle)
        here = mine | cache.global_set if self.rank in joined else mine  # (joined: it stands in for them)
        vec = cache.encode(flags, cache.member & ~here)
        result = np.empty_like(vec)
        self.bitvector_bytes += vec.nbytes
        self.negotiation_calls += 1
        self._allreduce_or(vec, result, busy=bool(pending) or self._job_busy)
        self._round_end = time.monotonic()
        all_flags, missing = cache.decode(result)
        self._job_busy = bool(all_flags & (FLAG_BUSY | FLAG_FULL | FLAG_EXPLAIN))
        self.busy_cycles += bool(all_flags & FLAG_BUSY)
        self.observer.agreed(all_flags)

        full = bool(all_flags & (FLAG_FULL | FLAG_EXPLAIN))
        self.full_cycles += full
        if all_flags & FLAG_EXPLAIN:
            responses = negotiation.explaining_round(self, shutdown)
        else:
            responses = cache.ready(missing, self.cycles)
            if full:
                responses = negotiation.vote_round(self, responses)
        if responses:  # a cached round's responses are all good ones; the global set's if it is the only one
            known = None if full or not self.psets.only_global() else bits.times_of(cache.ready_bits)
            self._agreed_at = time.monotonic()
            self.observer.before_run(responses, pending, self._agreed_at, known)
            self.completion.execute(responses)
            if self.join_cycle >= 0 and any(r.error is None and r.sig.kind is Kind.JOIN for r in responses):
                self.join_cycle, self.completion.joined = -1, frozenset()
        self.observer.after_run(self.comm)

    def _allreduce_or(self, vec: np.ndarray, result: np.ndarray, busy: bool) -> None:
        """Bitwise-or ``vec`` across ranks, backing off to 1 ms between polls (5 ms when idle)."""
        wait = functools.partial(polling.wait, cap=0.001 if busy else 0.005, arrival=True)
        wait(start_allreduce(self.comm, self.mpi_ops.tree, vec, result, None, self.mpi_ops.BOR, wait))

    def _waiting_names(self) -> list[str]:
        """The names this rank waits on, pending or still queued (a wedged wait's message lists them)."""
        with self._cv:
            queued = [req.name for req in list(self._queue)]  # (list() in C: submit() appends without the lock)
        return sorted({name for _, name in self.completion.pending} | set(queued))
