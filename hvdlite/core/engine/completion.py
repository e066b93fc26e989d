"""The engine's completing half: the pending table, agreed responses run in order, each request's result or error."""
from __future__ import annotations

from typing import Any, Optional

from ..errors import HvdliteError, InvalidArgumentError, StallError, TensorMismatchError
from ..log import logger
from . import mpi
from .cache import PendingBits, ResponseCache
from .execution import Executor
from .fusion import Item, batches
from .names import Names
from .psets import Registry
from .requests import Kind, Request, Response
from .stalls import Stop
from .timeline import Timeline


class Completion:
    """The requests this rank has pending (``pending``: taken from the queue; ``inflight``: the names from
    submission to ``finish``) and how each ends: ``finish`` frees the name, then completes the handle."""

    def __init__(self, rank: int, comm: Any, psets: Registry, cache: ResponseCache, executor: Executor,
                 timeline: Timeline, names: Optional[Names], keep_times: bool) -> None:
        self.rank = rank
        self.comm = comm
        self.psets = psets
        self.cache = cache
        self.executor = executor
        self.timeline = timeline
        self.names = names  # told of every name a stall verdict or join error fails, on every rank
        self.inflight: dict[tuple[int, str], Request] = {}  # (process set, name): one name table per set
        self.pending: dict[tuple[int, str], Request] = {}
        self.joined: frozenset[int] = frozenset()  # the ranks agreed to have joined: the global set's stand-ins
        self.bits = PendingBits(cache, keep_times=keep_times)  # the pending requests' cache bits

    def execute(self, responses: list[Response]) -> None:
        """Run agreed responses in order: data work fused in batches up to the next control op, which runs after it."""
        work: list[tuple[Response, Optional[Request]]] = []
        pending, psets, tracing = self.pending, self.psets, self.timeline.enabled
        for resp in responses:
            req = pending.get(resp.key)
            if resp.error is not None:
                if resp.error_kind in ("stall", "join") and self.names is not None:  # job-wide: every rank
                    self.names.learn(resp.name, resp.sig.ps_id, req is not None)       # skips the name
                elif resp.error_kind == "behind" and self.rank not in resp.joined:
                    continue  # ranks out of step (negotiation.py): this rank's op waits for the looping ranks' next
                elif resp.error_kind == "behind" and self.names is not None:
                    self.names.give_back(resp.name, resp.sig.ps_id)  # this rank's next op of the kind meets the others'
                if req is not None:
                    kind = _ERROR_KINDS.get(resp.error_kind, TensorMismatchError)
                    self.finish(req, error=kind(f"rank {self.rank}: {resp.error}"))
                continue
            sig = resp.sig
            if sig.kind.control:
                self._run_work(work)
                work = []
                result = psets.apply(sig.kind, sig.extra, self.comm)
                if sig.kind is Kind.REMOVE_PROCESS_SET:
                    self.cache.remove_process_set(sig.extra)
                if self.executor.planes is not None:  # a set's planes are made and closed with it
                    self.executor.planes.set_changed(sig.kind is Kind.ADD_PROCESS_SET, result, psets.comms.get(result))
                if req is not None:
                    self.finish(req, result)
                continue
            if req is None:
                if not psets.is_member(sig.ps_id):
                    continue
                if self.rank not in resp.joined and self.rank not in self.joined and sig.kind is not Kind.JOIN:
                    raise HvdliteError(f"rank {self.rank}: internal error: agreed to run {resp.name!r} but it "
                                       f"is not pending here")
            elif tracing:
                self.timeline.begin(req.name, "QUEUE")  # (ends its negotiation phase)
            work.append((resp, req))
        self._run_work(work)

    def _run_work(self, work: list[tuple[Response, Optional[Request]]]) -> None:
        for batch in batches(work, self.executor.config.fusion_threshold_bytes):
            try:
                results = self.executor.run(batch)  # (a failing data plane ends the job)
            except (HvdliteError, Stop):  # the job's end (a wedged wait included), not this batch's error
                raise
            except Exception as exc:  # noqa: BLE001 - an error of one batch fails that batch only
                if mpi.is_process_failure(exc):  # a lost peer (ULFM) ends the job's engine, not one batch
                    raise
                self._fail_batch(batch, exc)
                continue
            for item, result in results:
                req = item.req
                if req is None:
                    continue
                if req.sig.kind.multi_tensor and type(item) is Item:
                    listed = req.results
                    if listed is None:
                        if len(req.inputs) == 1:  # one tensor: a list only if wait() reads it
                            self.finish(req, [result] if req.reads_result() else None)
                            continue
                        listed = req.results = [None] * len(req.inputs)
                        req.remaining = len(listed)
                    listed[item.index] = result
                    req.remaining -= 1
                    if req.remaining == 0:
                        self.finish(req, listed)
                else:
                    self.finish(req, result)

    def _fail_batch(self, batch: list[Any], exc: Exception) -> None:
        """Fail the requests of one batch that raised before or between its MPI calls (alike on every rank)."""
        names = sorted({item.resp.name for item in batch})
        logger.error("collective(s) %s failed on this rank: %s: %s", ", ".join(names), type(exc).__name__, exc)
        for item in batch:
            if item.req is not None:
                error = HvdliteError(f"rank {self.rank}: {item.resp.sig.kind} of {item.resp.name!r} failed: "
                                     f"{type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self.finish(item.req, error=error)

    def finish(self, req: Request, result: Any = None, error: Optional[BaseException] = None) -> None:
        """Hand a result back, the name freed first: the caller may submit it again at once (the next step)."""
        key = req.key
        if self.pending.pop(key, None) is not None:
            self.bits.remove(req)
        if self.timeline.enabled:
            self.timeline.end(req.name)
        self.inflight.pop(key, None)  # one atomic operation: submit() takes no lock
        req.settle(result, error)

    def take_all(self) -> list[Request]:
        """Every pending request, the tables emptied (the engine's end: it fails them). Under the engine's lock."""
        waiting = list(self.pending.values())
        self.pending.clear()
        self.inflight.clear()
        return waiting


_ERROR_KINDS = {"stall": StallError, "invalid": InvalidArgumentError}  # else TensorMismatchError
