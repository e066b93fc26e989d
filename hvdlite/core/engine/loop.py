"""The engine loop: the one thread per process that negotiates, fuses and runs every collective.

Pipeline: user threads ``submit()`` requests -> each cycle, ``negotiation`` agrees which run -> ``fusion``
groups them into batches -> ``execution`` runs each batch's MPI calls -> handles complete.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np

from ..config import Config
from ..errors import (DuplicateNameError, HvdliteError, InvalidArgumentError, ShutdownError, StallError,
                      TensorMismatchError)
from ..log import logger
from . import deterministic, polling, stalls, stragglers
from .autotune import Autotuner
from .execution import Executor
from .plane_exec import PlaneExecutor
from .fusion import Item, batches
from .mpi import MPIOps
from .presence import GRACE_S, Presence
from .negotiation import (FLAG_BUSY, FLAG_FULL, FLAG_SHUTDOWN, PendingBits, ResponseCache, Stalled,
                          allgather_messages, decide, pending_message)
from .psets import Registry
from .requests import Kind, Request, Response
from .timeline import Timeline, negotiate_activity


class Engine:
    """Owns the engine communicator; user threads only ``submit()`` requests and wait on handles."""

    def __init__(self, comm: Any, mpi_ops: MPIOps, config: Config, timeline: Timeline,
                 process_sets: Registry, presence_comm: Any,
                 on_verdict: Callable[[str, int], None] = lambda name, ps_id: None, planes: Any = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.config = config
        self.timeline = timeline
        self.psets = process_sets
        self.on_verdict = on_verdict  # told of every name a stall verdict fails, on every rank
        self.cache = ResponseCache(config.cache_capacity, self.rank)
        self.mpi_ops = mpi_ops
        self.presence = Presence(presence_comm)
        self.executor = Executor(mpi_ops, deterministic.comms(process_sets.comm, mpi_ops, config.deterministic),
                                 process_sets.size, config.fusion_threshold_bytes, config.allreduce_chunk_bytes,
                                 timeline, process_sets.members)
        self.planes = PlaneExecutor(planes, process_sets.comm, process_sets.members, timeline, _Stop)
        self._lock = threading.Lock()  # a plain lock: submit() takes it per op (a Condition's own is Python code)
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[Request] = collections.deque()
        self._inflight: set[tuple[int, str]] = set()  # (process set, name): one name table per set
        self._pending: dict[tuple[int, str], Request] = {}
        self._bits = PendingBits(self.cache)  # the cache bits of the pending requests
        self._shutdown_requested = False
        self._sleeping = False  # the engine waits on _cv: a submission must notify it
        self.error: Optional[BaseException] = None
        self.cycles = 0
        self.full_cycles = 0
        self.bitvector_bytes = 0    # bytes each rank contributed to the per-cycle bit-vector all-reduces
        self.full_path_bytes = 0    # bytes allgathered (every rank's message) on full negotiation rounds
        self._join_cycle = -1
        self._last_stall_check = time.monotonic()
        self._last_stall_warning = float("-inf")
        self._last_cycle = 0.0
        self._job_busy = False  # some rank had work in the last round
        self.busy_cycles = 0
        self._idle_pause = 0.0
        self.autotune = Autotuner(config, self.rank, self.executor)
        self.stragglers = stragglers.Stragglers(config, self.rank, self.size)
        self._thread = threading.Thread(target=self._main, name="hvdlite-engine", daemon=True)
        self._thread.start()

    # -- user threads -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        key = req.key
        with self._lock:
            if self.error is not None:
                raise self.error
            if key in self._inflight:
                raise DuplicateNameError(
                    f"rank {self.rank}: a collective named {req.name!r} is already in flight; wait for "
                    f"it with synchronize() before reusing the name, or give each op its own name")
            self._inflight.add(key)
            self._queue.append(req)
            if self._sleeping:  # a busy engine takes the queue at its next cycle: no wake-up to pay for
                self._cv.notify()

    def stop(self, timeout: float = 60.0) -> None:
        """Ask every rank's engine to stop (collectively) and wait for this one to finish."""
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
        return {"cycles": self.cycles, "full_cycles": self.full_cycles, "mpi_calls": self.executor.mpi_calls,
                "busy_cycles": self.busy_cycles, "bitvector_bytes": self.bitvector_bytes,
                "full_path_bytes": self.full_path_bytes}

    # -- engine thread --------------------------------------------------------------------------
    def _main(self) -> None:
        polling.set_watch(self._watch)
        polling.fine_timer_slack()
        try:
            while self._wait_for_work():
                self._cycle()
        except _Wedged as wedged:
            logger.error("%s", wedged.message)
            self._fail_everything(StallError(wedged.message))
        except _Stop as stop:
            self._fail_everything(ShutdownError(stop.message))
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting handle
            detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            logger.error("the engine failed:\n%s", detail)
            error = exc if isinstance(exc, HvdliteError) else HvdliteError(
                f"rank {self.rank}: the hvdlite engine failed with {type(exc).__name__}: {exc}. "
                f"Every pending and later collective raises this error; restart the job.")
            self._fail_everything(error)

    def _wait_for_work(self) -> bool:
        """Sleep while there is nothing to do; return when a cycle should run.

        Every cycle is a world-wide round, so while some process set leaves ranks out, a rank with nothing
        of its own still takes part at once while any rank is busy (the BUSY flag of the last round says
        so): a set's ops never wait for idle non-members. With only sets of every rank, each op needs every
        rank's own submission anyway, so an idle rank waits for its own (no empty round after each op).
        Otherwise it backs off, doubling its pause from the cycle time up to ``idle_heartbeat_seconds``;
        a local submission ends the pause at once.
        """
        cycle_s = self.config.cycle_time_ms / 1000.0
        with self._cv:
            if self._pending:  # left over: pace cycles so waiting for peers does not spin
                delay = self._last_cycle + cycle_s - time.monotonic()
                if delay > 0:
                    self._sleep(delay)
                return True
            if self._queue or self._shutdown_requested:
                return True
            if self._job_busy:
                self._idle_pause = cycle_s
                if self.psets.has_partial_sets():
                    return True
            self._idle_pause = min(self.config.idle_heartbeat_seconds, max(cycle_s, 1e-4, self._idle_pause * 2))
            self._sleep(self._idle_pause)
        return True

    def _sleep(self, seconds: float) -> None:
        """Wait on the condition (its lock held) until a submission or the timeout."""
        self._sleeping = True
        try:
            self._cv.wait(seconds)
        finally:
            self._sleeping = False

    def _cycle(self) -> None:
        self._last_cycle = time.monotonic()
        self.cycles += 1
        with self._cv:
            new = list(self._queue)
            self._queue.clear()
            shutdown = self._shutdown_requested
        tracing = self.timeline.enabled
        for req in new:
            self._pending[req.key] = req
            if req.sig.kind is Kind.JOIN:
                self._join_cycle = self.cycles
            if tracing:
                self.timeline.begin(req.name, negotiate_activity(req.kind, req.op), kind=req.kind.label)
        self.timeline.cycle(self.cycles)

        flags = FLAG_SHUTDOWN | FLAG_FULL if shutdown else 0
        cache = self.cache
        mine = self._bits.add(new, self._pending)
        if self._bits.uncached:
            flags |= FLAG_FULL
        if self._stall_check_due():
            flags |= FLAG_FULL
        if self._pending:
            flags |= FLAG_BUSY
        if self.autotune.wants_round():  # rank 0's new settings travel in a full round
            flags |= FLAG_FULL
        vec = cache.encode(flags, cache.member & ~mine)
        result = np.empty_like(vec)
        self.bitvector_bytes += vec.nbytes
        self._allreduce_or(vec, result, busy=bool(self._pending) or self._job_busy)
        all_flags, missing = cache.decode(result)
        self._job_busy = bool(all_flags & (FLAG_BUSY | FLAG_FULL))
        self.busy_cycles += bool(all_flags & FLAG_BUSY)
        self.stragglers.settle(self.timeline)  # the window whose swap started last cycle (every rank is past it)

        if all_flags & FLAG_FULL:
            responses = self._full_round(shutdown)
        else:
            responses = cache.ready(missing, self.cycles)
        if responses:
            self.stragglers.record(responses, self._pending, time.monotonic(), self.timeline)
            self.autotune.observe(responses)
            self._execute(responses)
            self.stragglers.swap(self.comm)  # a window complete in this cycle: start swapping its times

    def _allreduce_or(self, vec: np.ndarray, result: np.ndarray, busy: bool) -> None:
        """Bitwise-or ``vec`` across ranks, backing off to 1 ms between polls (5 ms when idle)."""
        polling.wait(self.comm.Iallreduce(vec, result, op=self.mpi_ops.BOR), 0.001 if busy else 0.005)

    def _watch(self, waited: float) -> bool:
        """Between the polls of every engine wait: answer peers' presence probes; once a wait has lasted
        longer than the stall shutdown time, probe the peers and fail with a StallError naming those that
        do not answer (a round or collective never completes without them). True restarts the count."""
        self.presence.serve()
        cfg = self.config
        limit = cfg.stall_shutdown_time_seconds if not cfg.stall_check_disable else 0.0
        if not 0 < limit < waited:
            return False
        absent = self.presence.absent()
        if absent:
            raise _Wedged(self._wedged_message(absent, waited + GRACE_S, limit))
        return True  # everyone answered: they are busy, not gone

    def _wedged_message(self, absent: list[int], waited: float, limit: float) -> str:
        with self._cv:
            queued = [req.name for req in self._queue]
        names = sorted({name for _, name in self._pending} | set(queued))
        return stalls.wedged_message(self.rank, self.size, absent, waited, limit, names)

    def _stall_check_due(self) -> bool:
        cfg = self.config
        if cfg.stall_check_disable or not self._pending:
            return False
        period = cfg.stall_check_time_seconds
        if cfg.stall_shutdown_time_seconds > 0:
            period = min(period, cfg.stall_shutdown_time_seconds)
        now = time.monotonic()
        if now - self._last_stall_check < period:
            return False
        oldest = min(req.submitted for req in self._pending.values())
        return now - oldest >= period

    def _full_round(self, shutdown: bool) -> list[Response]:
        self.full_cycles += 1
        now = time.monotonic()
        msg = pending_message(self._pending.values(), now, shutdown=shutdown, join_cycle=self._join_cycle,
                              tune=self.autotune.outgoing())
        sizes: list[int] = []
        messages = allgather_messages(self.comm, msg, sizes)
        self.full_path_bytes += sum(sizes) + 8 * len(sizes)
        stopping = [r for r, m in enumerate(messages) if m.shutdown]
        if stopping:
            raise _Stop(stalls.shutdown_message(self.rank, stopping))
        if messages[0].tune is not None:  # every rank switches here, at the same cycle (agreement rule)
            self.autotune.adopt(messages[0].tune, self.cycles)
        responses, stalled = decide(messages, self.psets.members_table(), self.size)
        self._last_stall_check = now
        if stalled and not self.config.stall_check_disable:
            responses.extend(self._handle_stalls(stalled))
        for resp in responses:
            if resp.error is None:
                self.cache.put(resp.name, resp.sig, self.psets.members(resp.ps_id), self.cycles)
        return responses

    def _handle_stalls(self, stalled: list[Stalled]) -> list[Response]:
        now = time.monotonic()
        if self.rank == 0 and stalls.warn(stalled, self.config, now - self._last_stall_warning):
            self._last_stall_warning = now
        return stalls.verdict(stalled, self.config)

    def _execute(self, responses: list[Response]) -> None:
        """Run agreed responses in agreed order. Data work is batched (fused) up to the next control op:
        a process-set change runs only after the data work agreed before it has finished."""
        work: list[tuple[Response, Optional[Request]]] = []
        pending, psets, tracing = self._pending, self.psets, self.timeline.enabled
        for resp in responses:
            req = pending.get(resp.key)
            if resp.error is not None:
                if resp.error_kind == "stall":
                    self.on_verdict(resp.name, resp.ps_id)
                if req is not None:
                    kind = _ERROR_KINDS.get(resp.error_kind, TensorMismatchError)
                    self._finish(req, error=kind(f"rank {self.rank}: {resp.error}"))
                continue
            sig = resp.sig
            if sig.kind.control:
                self._run_work(work)
                work = []
                result = psets.apply(sig.kind, sig.extra, self.comm)
                if sig.kind is Kind.REMOVE_PROCESS_SET:
                    self.cache.remove_process_set(sig.extra)
                self.planes.set_changed(sig.kind is Kind.ADD_PROCESS_SET, result, psets.comms.get(result))
                if req is not None:
                    self._finish(req, result=result)
                continue
            if req is None:
                if not psets.is_member(sig.ps_id):
                    continue
                if self.rank not in resp.joined and sig.kind is not Kind.JOIN:
                    raise HvdliteError(f"rank {self.rank}: internal error: agreed to run {resp.name!r} but it "
                                       f"is not pending here")
            elif tracing:
                self.timeline.end(req.name)
                self.timeline.begin(req.name, "QUEUE")
            work.append((resp, req))
        self._run_work(work)
        if self._join_cycle >= 0 and any(r.error is None and r.kind is Kind.JOIN for r in responses):
            self._join_cycle = -1

    def _run_work(self, work: list[tuple[Response, Optional[Request]]]) -> None:
        for batch in batches(work, self.executor.fusion_threshold_bytes):
            runner: Any = self.planes if batch[0].resp.sig.plane else self.executor  # a failing plane ends the job
            try:
                results = runner.run(batch)
            except (HvdliteError, _Stop):  # the job's end (a wedged wait included), not this batch's error
                raise
            except Exception as exc:  # noqa: BLE001 - an error of one batch fails that batch only
                self._fail_batch(batch, exc)
                continue
            for item, result in results:
                req = item.req
                if req is None:
                    continue
                if req.sig.kind.multi_tensor and type(item) is Item:
                    if req.remaining == 1 and req.results is None:  # one tensor: a list only if wait() reads it
                        self._finish(req, result=[result] if req.reads_result() else None)
                        continue
                    listed = req.results
                    if listed is None:
                        listed = req.results = [None] * len(req.inputs)
                    listed[item.index] = result
                    req.remaining -= 1
                    if req.remaining == 0:
                        self._finish(req, result=listed)
                else:
                    self._finish(req, result=result)

    def _fail_batch(self, batch: list[Any], exc: Exception) -> None:
        """Fail the requests of one batch that raised before or between its MPI calls. Every rank ran the
        same batch on agreed shapes, dtypes and arguments, so every rank fails it the same way."""
        names = sorted({item.resp.name for item in batch})
        logger.error("collective(s) %s failed on this rank: %s: %s", ", ".join(names), type(exc).__name__, exc)
        for item in batch:
            if item.req is not None and item.req.handle is not None:
                error = HvdliteError(f"rank {self.rank}: {item.resp.kind} of {item.resp.name!r} failed: "
                                     f"{type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._finish(item.req, error=error)

    def _finish(self, req: Request, result: Any = None, error: Optional[BaseException] = None) -> None:
        """Hand a result back. The name is freed before the handle completes, so the caller may reuse
        it at once (the next training step submits the same names)."""
        key = req.key
        if self._pending.pop(key, None) is not None:
            self._bits.remove(req)
        if self.timeline.enabled:
            self.timeline.end(req.name)
        self._inflight.discard(key)  # one atomic set operation: submit() reads it under the lock
        if error is not None:
            req.set_error(error)
        else:
            req.set_result(result)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cv:
            self.error = error
            waiting = list(self._pending.values()) + list(self._queue)
            self._queue.clear()
            self._pending.clear()
            self._inflight.clear()
        for req in waiting:
            req.handle.set_error(error)
        self.timeline.stop()


_ERROR_KINDS = {"stall": StallError, "invalid": InvalidArgumentError}  # else TensorMismatchError


class _Stop(Exception):
    """Ends the engine loop: the job is shutting down (a rank called shutdown() or exited)."""

    @property
    def message(self) -> str:
        return str(self.args[0])


class _Wedged(_Stop):
    """Ends the engine loop: a wait outlasted the stall shutdown time and some peers do not answer."""


__all__ = ["Engine"]
