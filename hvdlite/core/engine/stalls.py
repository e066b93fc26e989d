"""The stall inspector: when to look, what is logged, which stalled names fail, and when a wait ends the job."""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Collection, Iterable, Optional, Sequence

import numpy as np

from ..config import Config
from ..log import logger
from . import callsite
from .messages import RankMessage
from .mpi import MPIOps
from .requests import Kind, Request, Response, Signature


class Stalled:
    """A name some members of its set have not submitted yet. Its ``note`` (the set the missing ranks used it in)
    and ``where`` (lines, what the missing ranks waited on instead) are worked out when a warning reads them."""

    __slots__ = ("name", "kind", "ready_ranks", "missing_ranks", "age", "sig", "again", "_note", "_where", "_context")

    def __init__(self, name: str, kind: Kind, ready_ranks: list[int], missing_ranks: list[int], age: float,
                 sig: Signature, context: Any, again: bool = False) -> None:
        self.name = name
        self.kind = kind
        self.sig = sig
        self.age = age
        self.again = again  # from a loop
        self.ready_ranks = ready_ranks
        self.missing_ranks = missing_ranks
        self._note: Optional[str] = None
        self._where = ""
        self._context = context  # (the round's table, its messages): what note and where are made from

    @property
    def note(self) -> str:
        if self._note is None:
            table, messages = self._context
            key = (self.sig.ps_id, self.name)
            self._note = used_elsewhere(table, messages, key[0], self.name, self.missing_ranks)
            self._where = submitted_at(messages, key, self.ready_ranks) + waiting_instead(messages, self.missing_ranks)
        return self._note

    @property
    def where(self) -> str:
        return self._where if self.note is not None else ""  # note works out both


def submitted_at(messages: Sequence[RankMessage], key: tuple[int, str], ranks: Iterable[int]) -> str:
    """Where each of ``ranks`` submitted ``key`` in the user's code (from their messages)."""
    return callsite.describe({r: messages[r].site(key) for r in ranks})


def waiting_instead(messages: Sequence[RankMessage], missing: list[int], most: int = 3) -> str:
    """What each missing rank had pending instead of a stalled name, with its lines."""
    parts = []
    for rank in missing:
        msg = messages[rank]
        pending = [f"{name!r} at {msg.site((sig.ps_id, name)) or 'an unknown line'}"
                   for name, sig in list(zip(msg.names, msg.signatures()))[:most]]
        listed = ", ".join(pending) + (f" and {len(msg.names) - most} more" if len(msg.names) > most else "")
        parts.append(f" Rank {rank} was waiting on {listed} instead." if pending
                     else f" Rank {rank} had submitted nothing.")
    return "".join(parts)


def used_elsewhere(table: dict[tuple[int, str], dict[int, int]], messages: Sequence[RankMessage], ps_id: int,
                   name: str, missing: list[int]) -> str:
    """For a stalled name: which missing ranks have it pending under another process set (legal order, so shown,
    not refused), in this round's table or in their other engines (``RankMessage.elsewhere``)."""
    used: dict[int, set[int]] = {}
    pairs = [(key, r) for key, entries in table.items() for r in entries if r in missing]
    for (other_ps, other_name), rank in pairs + [(key, r) for r in missing for key in messages[r].elsewhere]:
        if other_name == name and other_ps != ps_id:
            used.setdefault(other_ps, set()).add(rank)
    return "; ".join(f"rank(s) {sorted(ranks)} submitted it for process set {other_ps} instead"
                     for other_ps, ranks in sorted(used.items()) if ranks)


class Stop(Exception):
    """Ends the engine loop: the job is shutting down (a rank called shutdown() or exited); str() says why."""


class Wedged(Stop):
    """Ends the engine loop: a wait outlasted the stall shutdown time and some peers do not answer."""


class Watchdog:
    """The engine's clock for stalls: when a round looks for them, rank 0's warnings, the verdicts, and the watch."""

    def __init__(self, config: Config, presence: Presence, waiting_names: Callable[[], list[str]],
                 fence: Optional[Callable[[list[int]], list[int]]] = None) -> None:
        self.config = config
        self.presence = presence  # (on a communicator of the engine's ranks: its rank and size are the engine's)
        self.waiting_names = waiting_names  # the names this rank waits on (pending or queued), sorted
        self.fence = fence  # ULFM jobs: kills given ranks' processes on this host (core/fencing.py)
        self.last_check = time.monotonic()  # the last full round (every full round looks for stalls)
        self._last_warning = self._looked = float("-inf")  # (_looked: watch()'s last look for stopped ranks)
        self._spared: dict[tuple[int, str], float] = {}  # see verdict()

    def watch(self, waited: float) -> bool:
        """Between the polls of every engine wait: answer probes; past STOPPED_S fence this host's stopped ranks (ULFM);
        past the stall shutdown time, silent peers: fenced (ULFM) or Wedged. True restarts the count."""
        self.presence.serve()
        if self.fence is not None and waited > STOPPED_S and time.monotonic() - self._looked >= 0.25:
            self._looked = time.monotonic()  # (a look reads /proc for every peer here: not at every poll of a wait)
            self.fence([])
        limit = 0.0 if self.config.stall_check_disable else self.config.stall_shutdown_time_seconds
        if not 0 < limit < waited:
            return False
        absent = self.presence.absent()
        if absent and self.fence is not None:
            self.fence(absent)
            return True
        if absent:  # this rank gives up: an MPI call waited past the limit and these ranks answer no probes
            answered = [r for r in range(self.presence.size) if r not in absent and r != self.presence.rank]
            raise Wedged(f"rank {self.presence.rank}: an MPI call of the engine has waited {waited + GRACE_S:.1f} s "
                         f"(stall_shutdown_time_seconds={limit:g}): rank(s) {absent} answer no messages (stopped, "
                         f"or blocked with the GIL held); rank(s) {answered} did. Pending on this rank: "
                         f"{self.waiting_names() or 'nothing'}. hvdlite cannot go on with this job: end it and look "
                         f"at rank(s) {absent}.")
        return True  # everyone answered: they are busy, not gone

    @property
    def period(self) -> float:
        """Seconds between stall checks while ops wait (at most the stall shutdown time, when one is set)."""
        shutdown, check = self.config.stall_shutdown_time_seconds, self.config.stall_check_time_seconds
        return min(check, shutdown) if shutdown > 0 else check

    def check_due(self, pending: Collection[Request]) -> bool:
        """Whether this cycle's round must be a full one to look for stalls (``pending``: this rank's)."""
        if self.config.stall_check_disable or not pending:
            return False
        period, now = self.period, time.monotonic()
        return now - self.last_check >= period and now - min(  # (a join waits for the others: never stalled)
            (req.submitted for req in pending if req.sig.kind is not Kind.JOIN), default=now) >= period

    def handle(self, stalled: list[Stalled]) -> list[Response]:
        """Rank 0 logs who did not submit what (at most once a period); every rank returns the same verdicts."""
        cfg, now = self.config, time.monotonic()
        period = cfg.stall_check_time_seconds
        if self.presence.rank == 0 and min(max(s.age for s in stalled), now - self._last_warning) >= period:
            self._last_warning = now
            lines = [f"  {s.name} ({s.kind}): submitted by ranks {s.ready_ranks}, missing ranks "
                     f"{s.missing_ranks}, waiting {s.age:.1f} s" + (f" ({s.note})" if s.note else "") + s.where
                     for s in stalled]
            ending = ("these waits end the job with an error after %g s (stall_shutdown_time_seconds)"
                      % cfg.stall_shutdown_time_seconds if cfg.stall_shutdown_time_seconds > 0 else
                      "without HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=S (hvdlite-run --stall-check-shutdown-time-seconds "
                      "S) these ranks wait until the missing ranks submit (only ranks out of step in a loop of unnamed "
                      "collectives fail, after %g s: stall_check_time_seconds); set it to fail the stalled ops after "
                      "S s instead" % period)
            logger.warning("One or more collectives have waited over %g s for other ranks. The missing "
                           "ranks have not submitted them (they may be stuck, have skipped the op, or "
                           "used a different name):\n%s\n%s; %s.", period, "\n".join(lines),
                           JOIN_HINT, ending)
        return verdict(stalled, cfg, self._spared)


#: The usual cause of a stall at the end of an epoch, and its fix (Horovod's hvd.join()).
JOIN_HINT = ("If ranks got different numbers of batches (uneven data), a rank whose data ended has moved on: "
             "call hvd.join() on every rank after its last batch (it stands in for the ops other ranks still "
             "run) before a metric allreduce")


def verdict(stalled: list[Stalled], cfg: Config, spared: Optional[dict[tuple[int, str], float]] = None
            ) -> list[Response]:
    """Once any stalled name is past the shutdown time every stalled name fails, in the same cycle on every rank,
    but those ahead() spares stay one period (``spared``, across verdicts: (set, name) -> agreed age then). With
    no shutdown time, ranks out of step that all wait (every member on a name the others have not made) would wait
    forever: past the check period the looping groups' names fail and the others' wait for those ranks."""
    def failure(s: Stalled, why: str) -> Response:
        note = f" {s.note[0].upper()}{s.note[1:]}: the ranks disagree on its process set." if s.note else ""
        return Response(s.name, s.sig, error_kind="stall", error=(
            f"{s.kind} of {s.name!r} stalled for {s.age:.1f} s ({why}): ranks {s.missing_ranks} never submitted "
            f"it; ranks {s.ready_ranks} did.{note}{s.where} {JOIN_HINT}."))
    limit = cfg.stall_shutdown_time_seconds
    if limit <= 0:
        waiting, spare = {r for s in stalled for r in s.ready_ranks}, ahead(stalled, float("inf"))
        if not spare or max(s.age for s in stalled) < cfg.stall_check_time_seconds or \
                any(set(s.ready_ranks + s.missing_ranks) != waiting for s in stalled):
            return []
        return [failure(s, "the other ranks wait on an op made after this loop") for s in stalled if s not in spare]
    if max(s.age for s in stalled) < limit:
        return []
    keep = {} if spared is None else spared
    for key in set(keep) - {(s.sig.ps_id, s.name) for s in stalled}:
        del keep[key]
    for s in ahead(stalled, limit):
        keep.setdefault((s.sig.ps_id, s.name), s.age)
    return [failure(s, f"stall_shutdown_time_seconds={limit:g}") for s in stalled
            if s.age >= keep.get((s.sig.ps_id, s.name), -limit) + limit]


def ahead(stalled: list[Stalled], limit: float) -> list[Stalled]:
    """Ranks out of step (some left a loop of unnamed collectives early): disjoint groups each wait on a generated
    name the others have not made yet. The names of the groups still in their loop (``again``) fail; the others'
    are returned: they stay one more period, for the failed ranks to reach after their error."""
    looping: dict[tuple[int, ...], bool] = {}
    for s in stalled:
        looping[tuple(s.ready_ranks)] = looping.get(tuple(s.ready_ranks), True) and s.again
    members = [rank for group in looping for rank in group]
    if len(members) != len(set(members)) or len({s.name for s in stalled}) != len(stalled) \
            or all(looping.values()) or not any(looping.values()):
        return []
    return [s for s in stalled if not looping[tuple(s.ready_ranks)] and ".noname." in s.name and s.age < 2 * limit]


def shutdown_message(rank: int, stopping: list[int]) -> str:
    """Why this rank's engine ends when ranks ``stopping`` said in a round that they shut down."""
    if rank in stopping and len(stopping) == 1:
        return f"rank {rank}: hvdlite was shut down on this rank (hvd.shutdown() or process exit)"
    who = ", ".join(map(str, stopping))
    return (f"rank {rank}: hvdlite was shut down because rank(s) {who} called hvd.shutdown() or "
            f"exited while this rank still expected collectives. Look at rank(s) {who} for the cause; "
            f"every rank must run the same collectives before finishing. {JOIN_HINT}; "
            f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=S turns a rank that never comes into an error after S s.")


STOPPED_S = 2.0  # how long a fault-tolerant job's engine waits before it kills its host's stopped ranks (if any)
_PROBE, _REPLY = 0x7E01, 0x7E02
GRACE_S = 2.0  # how long a prober waits for answers (answering takes one poll of a waiting engine)


class Presence:
    """Answers peers' probes, and probes peers. Used only by the engine thread."""

    def __init__(self, comm: Any, mpi_ops: MPIOps) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._ids = itertools.count(1)
        self._sends: list[Any] = []
        self._status = mpi_ops.MPI.Status()
        self._any = mpi_ops.MPI.ANY_SOURCE

    def serve(self) -> None:
        """Answer every probe that has arrived (cheap when none has: one Iprobe)."""
        while self.comm.Iprobe(source=self._any, tag=_PROBE, status=self._status):
            source = self._status.Get_source()
            probe = np.zeros(1, dtype=np.int64)
            self.comm.Recv(probe, source=source, tag=_PROBE)
            self._sends.append(self.comm.Isend(probe, dest=source, tag=_REPLY))
        self._sends = [s for s in self._sends if not s.Test()]

    def absent(self, grace_s: float = GRACE_S) -> list[int]:
        """Probe every peer; return the ranks that did not answer within ``grace_s`` seconds."""
        probe_id = next(self._ids)
        peers = [r for r in range(self.size) if r != self.rank]
        out = np.full(1, probe_id, dtype=np.int64)
        sends = [self.comm.Isend(out, dest=r, tag=_PROBE) for r in peers]
        replies = {r: np.zeros(1, dtype=np.int64) for r in peers}
        recvs = {r: self.comm.Irecv(replies[r], source=r, tag=_REPLY) for r in peers}
        answered: set[int] = set()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(answered) < len(peers):
            self.serve()
            for r, req in recvs.items():
                if r not in answered and req.Test():
                    if int(replies[r][0]) == probe_id:
                        answered.add(r)
                    else:  # an answer to an older probe: wait for this one's
                        recvs[r] = self.comm.Irecv(replies[r], source=r, tag=_REPLY)
            time.sleep(1e-3)
        self._sends.extend(sends)
        return sorted(set(peers) - answered)
