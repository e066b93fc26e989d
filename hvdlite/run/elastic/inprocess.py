"""The elastic driver's in-process mode: which mode a run uses, the ULFM launch flags, and following lost ranks
while the survivors recover by themselves (hvdlite/core/recovery.py) instead of being restarted."""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from typing import Callable, Iterator, Optional

from hvdlite.core.launch import fence_command, kill_if_same, probe_ulfm, start_ticks

from ..hosts import Host, HostSpecError, hosts_by_rank, merge
from ..launchers import OPENMPI, Launcher, LaunchError
from .server import RankInfo, is_local

#: Open MPI 5's fault tolerance: ULFM on, shared memory between a host's ranks and TCP across hosts, the failure
#: detector's heartbeats, MPI_Finalize without its closing PMIx fence (after a lost rank it sometimes never ended),
#: and a waiting rank that gives its core away (a shrink on more ranks than cores): docs/elastic.md, "Turning ULFM on".
ULFM_MPI_ARGS = ["--with-ft", "ulfm", "--mca", "btl", "sm,tcp,self", "--mca", "mpi_ft_detector", "true",
                 "--mca", "async_mpi_finalize", "true", "--mca", "mpi_yield_when_idle", "true"]


def ulfm_mpi_args(user: list[str]) -> list[str]:
    """In-process mode's flags, then the user's --mpi-args, whose ``--mca btl`` replaces our ``sm,tcp,self`` (Open
    MPI refuses one parameter given twice; docs/elastic.md, "Which transport")."""
    ours = list(ULFM_MPI_ARGS)
    if any(flag in ("--mca", "-mca") and name == "btl" for flag, name in zip(user, user[1:])):
        at = ours.index("btl") - 1
        del ours[at:at + 3]
    return [*ours, *user]


STOPPED_S = 4.0  # a rank here stopped that long is killed by the driver (twice engine/stalls.py's: theirs come first)
#: The setting that tells the ranks which mode they run in (hvdlite/core/config.py, elastic_mode).
MODE_VARIABLE = "HVDLITE_ELASTIC_MODE"


def choose_mode(asked: str, launcher: Launcher) -> tuple[bool, str]:
    """(in-process?, why) for ``--elastic-mode asked`` with this launcher; ValueError if in-process cannot work."""
    if asked == "restart":
        return False, "restart mode (--elastic-mode restart): a lost rank restarts the job from its last commit"
    usable, why = probe_ulfm()
    if usable and launcher.kind != OPENMPI:
        usable, why = False, f"{why}, but the ranks are started by {launcher.kind}, not Open MPI's mpirun"
    if usable:
        return True, (f"in-process mode: {why}; the ranks start with {' '.join(ULFM_MPI_ARGS)} (without the "
                      f"sentinel), and the survivors of a lost rank recover in their own processes")
    if asked == "in-process":
        raise ValueError(f"--elastic-mode in-process needs an MPI library with ULFM (Open MPI 5, pip install "
                         f"openmpi) started by its mpirun: {why}")
    return False, f"restart mode: {why}; a lost rank restarts the job from its last commit"


@dataclasses.dataclass
class Losses:
    """The ranks lost during one in-process job, each counted once, what they leave, and how many resets they
    cost: one per recovery of the survivors, however many ranks it drops (as Horovod counts --reset-limit)."""

    size: int
    before: int = 0  # the resets of the run before this job started
    seen: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (rank at the start, pid) counted
    recovered_to: set[int] = dataclasses.field(default_factory=set)  # the sizes the survivors' recoveries left
    fenced: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # (host, pid) the driver fenced
    stopped: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)  # (host, pid) -> seen stopped

    def new(self, ranks: list[RankInfo]) -> Iterator[RankInfo]:
        """The lost ranks not reported before, oldest first, each counted as it is yielded (``alive``: what it left)."""
        fresh = sorted((r for r in ranks if r.ended == "lost" and (r.rank, r.pid) not in self.seen),
                       key=lambda r: r.ended_at)
        for lost in fresh:
            self.seen.add((lost.rank, lost.pid))
            yield lost

    def note_recoveries(self, ranks: list[RankInfo]) -> None:
        """Take in the recoveries the survivors reported (every recovery shrinks the job: the size it left names it)."""
        for info in ranks:
            self.recovered_to.update(info.recovered)

    def to_fence(self, ranks: list[RankInfo], now: float) -> list[tuple[RankInfo, int, str]]:
        """The ranks to end, once each, with start ticks and why: declared lost by the survivors but still connected
        (alone on a host, none there ends them), and this host's ranks stopped (SIGSTOP) for STOPPED_S."""
        declared = {(host, pid): started for info in ranks for host, pid, started in info.declared_lost}
        found = []
        for info in ranks:
            started = declared.get((info.host, info.pid), 0)
            why = "was declared failed by the survivors but its process is still there (stopped or wedged)"
            ticks = start_ticks(info.pid, stopped=True) if not info.ended and is_local(info.host) else 0
            if not ticks:
                self.stopped.pop((info.host, info.pid), None)
            elif now - self.stopped.setdefault((info.host, info.pid), now) >= STOPPED_S:
                started, why = ticks, f"has been stopped (SIGSTOP) for {STOPPED_S:.0f} s, and no rank ended it"
            if started and not info.ended and (info.host, info.pid) not in self.fenced:
                self.fenced.add((info.host, info.pid))
                found.append((info, started, why))
        return found

    @property
    def resets(self) -> int:
        """The reported recoveries from the losses seen so far (one reported before the driver saw its lost rank
        counts once it does), plus one for lost ranks that no reported recovery covers yet."""
        covered = {size for size in self.recovered_to if size >= self.alive}
        return len(covered) + (1 if self.alive < min(covered, default=self.size) else 0)

    @property
    def alive(self) -> int:
        return self.size - len(self.seen)


def none_joined(code: int, size: int, joined_before: bool, in_process: bool, log: logging.Logger) -> str:
    """The outcome of a job none of whose ``size`` ranks reached hvd.elastic.run: "done" (a program that does not use
    it, exit code 0 where it proves something: not under ULFM), "fatal" (said here), or, once a rank of this run
    reached it (``joined_before``), a reset: ranks that end before it were lost, like any other."""
    if joined_before:
        return (f"none of the {size} ranks reached hvd.elastic.run (lost before it: killed, or failed at start-up; "
                f"the launcher exited {code}), while this run's earlier ranks did")
    if code == 0 and not in_process:
        log.warning("no rank used hvd.elastic.run; the job exited 0: done")
        return "done"
    ulfm = (" (under ULFM the launcher exits 0 even when ranks were killed, so that 0 says nothing of how they "
            "ended)" if in_process and not code else "")
    log.error("stopping: the job exited %d before any rank reached hvd.elastic.run%s (the program fails at start-up, "
              "or it does not use hvd.elastic.run); not restarting it", code, ulfm)
    return "fatal"


def finished(ranks: list[RankInfo], size: int) -> bool:
    """Every rank that joined and was not lost said it was done (the lost ranks' work went on in the survivors)."""
    alive = [r for r in ranks if r.ended != "lost"]
    return len(ranks) == size and bool(alive) and all(r.ended == "done" for r in alive)


def report(logger: logging.Logger, lost: RankInfo, losses: Losses, reset: int, limit: Optional[int],
           joined: bool) -> None:
    """Say that ``lost`` failed: a new reset, or (``joined``) one more rank of the reset under way."""
    of = f" of {limit}" if limit is not None else ""
    also = " too, with the rank(s) of this reset: one recovery" if joined else ""
    logger.info("reset %d%s: rank %d on host %s (pid %d) failed%s; %d ranks left recover in their processes "
                "(in-process mode)", reset, of, lost.rank, lost.host, lost.pid, also, losses.alive)
    if not _explained:
        _explained.append(True)
        logger.info("%s", NBC_NOTE)


#: Said once per run, at the first in-process recovery: what Open MPI's own lines about it mean.
NBC_NOTE = ("(Open MPI's \"NBC_Progress: an error 75 (or 77) was found during schedule ... - aborting the schedule\" "
            "lines at a recovery are the survivors' pending non-blocking collectives ending with MPI_ERR_PROC_FAILED "
            "(75) or MPI_ERR_REVOKED (77): the loss being recovered from, expected; nothing else failed)")
_explained: list[bool] = []


def fence(logger: logging.Logger, rank: RankInfo, started: int, why: str, placement: list[str],
          command_on: Callable[[str, list[str]], tuple[list[str], dict[str, str]]]) -> None:
    """Kill a rank that is still there (Losses.to_fence: ``why``) on its host (``command_on``)."""
    logger.warning("rank %d on host %s (pid %d) %s: ending it (SIGKILL) so that it cannot hold the job's end or "
                   "come back", rank.rank, rank.host, rank.pid, why)
    host = placement[rank.rank] if rank.rank < len(placement) else rank.host
    if is_local(host):
        kill_if_same(rank.pid, started)
        return
    try:
        cmd, env = command_on(host, fence_command(sys.executable, rank.pid, started))
    except (HostSpecError, LaunchError, OSError) as exc:
        logger.error("cannot reach host %s to end rank %d (pid %d): %s", host, rank.rank, rank.pid, exc)
        return
    subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL)


@dataclasses.dataclass(frozen=True)
class Added:
    """Hosts discovery added to a running job, and when the driver saw them (time.monotonic())."""

    hosts: tuple[str, ...]
    seen_at: float


GROWTH_PATH = ("new hosts join through a restart at a commit boundary, in both modes: Open MPI 5.0 can grow a "
               "running job only with Comm.Spawn, after which one of the job's first ranks exiting with an error "
               "hangs the survivors' recovery")


def running_on(placed: list[Host], size: int, lost: set[tuple[int, int]]) -> list[Host]:
    """The slots a job started with ``size`` ranks on ``placed`` still runs on after losing ``lost`` ((rank at the
    start, pid)): compared with the usable hosts, the lost ranks' slots listed again make the job grow back."""
    gone = {rank for rank, _ in lost}
    return merge([Host(name, 1) for rank, name in enumerate(hosts_by_rank(placed, size)) if rank not in gone])
