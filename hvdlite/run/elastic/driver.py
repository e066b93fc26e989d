"""The elastic driver: run the job as a loop of MPI jobs on the healthy hosts, restarting after a failure
or a host change, until the job finishes or the reset limit is reached."""
from __future__ import annotations

import argparse
import copy
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Mapping, Optional

from hvdlite.core.launch import (DRIVER_VARIABLE, GENERATION_VARIABLE, JOB_VARIABLE, MIN_NP_VARIABLE, RESTART_VARIABLE,
                                 SECRET_VARIABLE, STANDBY_VARIABLE)

from ..commands import Plan, build_command, child_environment, format_command
from ..hosts import Host, HostSpecError, hosts_by_rank, total_slots
from ..launchers import SRUN, Launcher, LaunchError
from ..process import kill_group, stop_with
from .cleanup import CommitRemover, remove_leftover_shm, shm_files
from . import inprocess
from .discovery import Blacklist, DiscoveryError, HostSource, assign, describe_failure, hopeless, wait_for_slots
from .server import DriverServer, RankInfo, bind_address, is_local
from .standby import Standby

#: Seconds between discovery runs while a job trains (horovodrun polls about once a second).
DISCOVERY_INTERVAL_S = 1.0
#: Seconds the launcher gets to end the job by itself after a rank was lost, before it is stopped.
LOST_RANK_GRACE_S = 5.0
STOP_GRACE_S = 10.0

logger = logging.getLogger("hvdlite.run.elastic")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("hvdlite-run: elastic: %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
logger.setLevel(logging.INFO)


class ElasticDriver:
    """One elastic run: hosts, blacklist, resets, and the TCP endpoint the ranks talk to."""

    def __init__(self, args: argparse.Namespace, env: Mapping[str, str], plan_launch: Any) -> None:
        self.args = args
        self.env = dict(env)
        self.plan_launch = plan_launch
        self.min_np = args.min_np or args.num_proc or 1
        self.max_np = args.max_np or max(args.num_proc or 0, self.min_np) or self.min_np
        if args.max_np is None and args.host_discovery_script:
            self.max_np = 1 << 30  # no upper bound given: use every discovered slot
        self.num_proc = args.num_proc or self.max_np  # no -np: start on every usable slot up to --max-np
        if not self.min_np <= self.num_proc <= self.max_np:
            raise HostSpecError(f"need --min-np <= -np <= --max-np, got {self.min_np} <= {self.num_proc} <= "
                                f"{self.max_np}")
        self.source = HostSource(args, env, self.max_np)
        self.blacklist = Blacklist(args.blacklist_cooldown_range)
        self.job = uuid.uuid4().hex[:12]
        self.secret = secrets.token_hex(32)  # the ranks' proof (hvdlite.core.elastic.link); kept out of every log
        self.server: Optional[DriverServer] = None
        self.resets = 0
        self.stop_signal = 0
        self.remover = CommitRemover(logger, job=self.job, env=self.env, command_on=self._command_on,
                                     verbose=args.verbose)
        self.in_process: Optional[bool] = None  # the mode (--elastic-mode), decided with the first launcher
        self.finished_on = 0  # in-process mode: the ranks left when the job finished
        self.added: Optional[inprocess.Added] = None  # hosts discovery added, until the job that uses them starts
        self.short_listing: Optional[list[Host]] = None  # the last discovery result too small to resize to
        self.srun = False  # the ranks are started by srun (stopped with SIGTERM)
        self.standby = Standby(logger, self._launch, self._stop)

    def usable_hosts(self) -> list[Host]:
        return self.blacklist.apply(self.source.discover())

    def hopeless(self) -> str:
        return hopeless(self.source.fixed, self.blacklist.for_good(), self.min_np)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.standby.discard()
            if self.server is not None:
                self.server.close()
            self.remover.remove_all()

    def _command_on(self, name: str, command: list[str]) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that run ``command`` once on host ``name`` through the launcher."""
        launcher, plan, _ = self._plan([Host(name, 1)], 1)
        plan.command = command
        env = child_environment(self.env, plan, launcher)
        return build_command(launcher, plan, env), env

    def _plan(self, placed: list[Host], size: int) -> tuple[Launcher, Plan, list[str]]:
        """The launcher and plan for ``size`` ranks on ``placed``."""
        args = copy.copy(self.args)
        args.num_proc = size
        if self.source.slurm:
            args.hosts = args.hostfile = None
            names = ",".join(h.name for h in placed)
            args.mpi_args = f"{args.mpi_args} --nodelist={names} -N {len(placed)}".strip()
        else:
            args.hosts, args.hostfile = ",".join(map(str, placed)), None
        return self.plan_launch(args, self.env)  # type: ignore[no-any-return]

    def _server_for(self, placed: list[Host]) -> DriverServer:
        """The endpoint on the interface this attempt's hosts reach us on (made again when that changes)."""
        address = bind_address([h.name for h in placed], self.args.nics or [])
        if self.server is None or self.server.address != address:
            server = DriverServer(lambda text: logger.info("%s", text), self.secret, bind=address)
            if self.server is not None:
                server.generation, server.joined_any = self.server.generation, self.server.joined_any
                self.server.close()
            self.server = server
            logger.info("listening for the ranks on %s:%d", address, server.port)
        return self.server

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _loop(self) -> int:
        logger.info("job %s: hosts from %s; --min-np %d --max-np %d", self.job, self.source.kind, self.min_np,
                    self.max_np)
        size = self.num_proc
        while True:
            hosts = wait_for_slots(self.usable_hosts, self.min_np, self.args.elastic_timeout, DISCOVERY_INTERVAL_S,
                                   lambda: bool(self.stop_signal), logger, self.hopeless)  # (--elastic-timeout)
            if hosts is None:
                if self.stop_signal:
                    return 128 + self.stop_signal
                if (why := self.hopeless()):
                    logger.error("stopping at once: %s", why)
                    return 1
                logger.error("stopping: fewer than %d slots (--min-np) were usable for %.0f s (--elastic-timeout)%s",
                             self.min_np, self.args.elastic_timeout,
                             "; blacklisted hosts wait out their cooldown" if self.blacklist.cooldown else "")
                return 1
            size = min(size if self.resets == 0 else self.max_np, total_slots(hosts), self.max_np)
            placed = assign(hosts, size)
            server = self._server_for(placed)
            server.new_attempt(self.resets)
            code, outcome = self._run_job(server, hosts, placed, size)
            if outcome == "done" and code:
                logger.error("stopping: every rank said done, but the launcher exited with code %d: a rank failed "
                             "after its training function returned (its output above says how)", code)
                return code
            if outcome == "done":
                logger.info("job finished on %d ranks after %d reset(s)", self.finished_on or size, self.resets)
                return 0
            if outcome == "signal":
                return 128 + self.stop_signal
            if outcome == "fatal":
                return code or 1
            self.resets += 1
            limit = self.args.reset_limit
            if limit is not None and self.resets > limit:
                logger.error("stopping: the job needed reset %d but --reset-limit is %d (last: %s); exit code %d",
                             self.resets, limit, outcome, code or 1)
                return code or 1
            logger.info("reset %d%s: %s; starting again", self.resets, f" of {limit}" if limit is not None else "",
                        outcome)

    def _run_job(self, server: DriverServer, hosts: list[Host], placed: list[Host], size: int) -> tuple[int, str]:
        if self.in_process is None:
            self._choose_mode(placed, size)
        listing, listed = hosts, {h.name for h in hosts}
        for name in [n for n in self.remover.ran_on if n not in listed]:  # dropped by discovery (or blacklisted)
            self.remover.remove_on(name)
        self.remover.wait(h.name for h in placed)  # a host back from the blacklist: its deletion is over
        self.remover.ran_on.update((h.name, h) for h in placed)
        proc = self.standby.take(placed, server)
        logger.info("starting %d ranks on %s (reset %d)%s", size, ",".join(map(str, placed)), self.resets,
                    f": the standby job started {time.monotonic() - self.standby.started_at:.1f} s ago takes over"
                    if proc is not None else "")
        shm = shm_files() if not self.in_process and all(is_local(h.name) for h in placed) else None
        if proc is not None:
            server.release(self.resets)
        else:
            proc = self._launch(placed, server)
        lost_at, changed = 0.0, False
        losses = inprocess.Losses(size, before=self.resets)
        added, self.added = self.added, None  # hosts added while the job before ran: this job uses them
        next_check = time.monotonic() + DISCOVERY_INTERVAL_S
        while proc.poll() is None:
            time.sleep(0.1)
            self.remover.poll()
            now = time.monotonic()
            if self.stop_signal:
                self._stop(proc)
                return proc.returncode, "signal"
            if self.in_process:
                counted = len(losses.seen)
                stopped = self._follow_losses(server, losses, proc, placed, size)
                if stopped:
                    return proc.returncode or 1, stopped
                if len(losses.seen) != counted and self.source.script:  # discovery listing the lost ranks' slots
                    hosts, next_check = inprocess.running_on(placed, size, losses.seen), now  # asked now: grows back
            elif not lost_at and any(r.ended == "lost" for r in server.snapshot()):
                lost_at = now
            self.standby.tend(bool(self.in_process and self.source.script and self.blacklist.failures)
                              and len(server.snapshot()) == size, listing, self.max_np, server)
            if lost_at and now - lost_at > LOST_RANK_GRACE_S:
                self._stop(proc)
            if added is not None and len(server.snapshot()) == size:
                logger.info("host(s) %s in use: %d ranks joined %.1f s after discovery added them%s", ",".join(
                    added.hosts), size, now - added.seen_at, f" ({inprocess.GROWTH_PATH})" if self.in_process else "")
                added = None
            if not changed and not lost_at and now >= next_check:
                next_check = now + DISCOVERY_INTERVAL_S
                changed = self._hosts_changed(server, hosts)
            if self.in_process and len(ranks := server.snapshot()) == size and {r.ended for r in ranks} in (
                    {"resize"}, {"resize", "lost"}):  # every host's commit is written (a rank says "resize" after
                break  # it): the next job starts now, while this one's processes and launcher end by themselves
        code = proc.returncode
        if code is not None:  # (one still ending is reaped by subprocess; hvdlite-run's exit ends it: stop_with)
            kill_group(proc.pid)
        for path in remove_leftover_shm(shm) if shm is not None else ():  # (MPICH's, of a rank killed in it)
            logger.info("deleted %s, the shared memory MPICH left behind on this host", path)
        ranks = server.snapshot()
        self.finished_on = losses.alive
        if not ranks:
            return code, inprocess.none_joined(code, size, server.joined_any, bool(self.in_process), logger)
        if self.in_process and inprocess.finished(ranks, size):
            return 0, "done"  # (the launcher's code counts the lost ranks)
        if not self.in_process and len(ranks) == size and all(r.ended == "done" for r in ranks):
            return code, "done"
        # (in-process mode: a rank the survivors already recovered from is not blamed again, say at a resize)
        fresh = [r for r in ranks if r.ended == "lost" and (r.rank, r.pid) not in losses.seen]
        if fresh:
            lost = min(fresh, key=lambda r: r.ended_at)
            standing = self._failed_on(placed, size, lost, remove=True)
            return code, f"rank {lost.rank} on host {lost.host} (pid {lost.pid}) failed; {standing}"
        if any(r.ended == "resize" for r in ranks):
            return code, "hosts changed: the ranks committed and left to resize"
        return code, f"the job ended with exit code {code} and no rank reported why"

    def _choose_mode(self, placed: list[Host], size: int) -> None:
        """Decide the run's mode (--elastic-mode) with the launcher of its first job."""
        launcher, _, _ = self._plan(placed, size)
        self.srun = launcher.kind == SRUN
        self.in_process, why = inprocess.choose_mode(self.args.elastic_mode, launcher)
        logger.info("%s", why)
        if self.in_process:  # without hvdlite-run's sentinel: Open MPI 5.0's launcher ended the whole ULFM job when
            self.args.launch_sentinel = False  # a second rank's sentinel exited 137; a lost rank is named anyway

    def _launch(self, placed: list[Host], server: DriverServer, standby: bool = False) -> subprocess.Popen[bytes]:
        """Start an MPI job on the slots ``placed`` (``standby``: a standby job, run/elastic/standby.py)."""
        launcher, plan, warnings = self._plan(placed, total_slots(placed))
        for warning in () if standby else warnings:
            logger.warning("%s", warning)
        if self.in_process:
            plan.mpi_args = inprocess.ulfm_mpi_args(plan.mpi_args)
        env = child_environment(self.env, plan, launcher)
        env.update({inprocess.MODE_VARIABLE: "in-process" if self.in_process else "restart",
                    MIN_NP_VARIABLE: str(self.min_np), DRIVER_VARIABLE: f"{server.address}:{server.port}",
                    JOB_VARIABLE: self.job, RESTART_VARIABLE: str(self.resets),
                    GENERATION_VARIABLE: str(server.generation)})
        if standby:
            env[STANDBY_VARIABLE] = "1"
        # the secret travels in the environment only: Open MPI's -x names it, no launcher gets its value
        # as an argument, and --verbose shows it hidden
        env[SECRET_VARIABLE] = self.secret
        cmd = build_command(launcher, plan, env)
        if self.args.verbose:
            shown = {k: ("<hidden>" if k == SECRET_VARIABLE else v) for k, v in env.items() if self.env.get(k) != v}
            logger.info("running: %s", format_command(cmd, shown))
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=stop_with(os.getpid()))

    def _follow_losses(self, server: DriverServer, losses: inprocess.Losses, proc: subprocess.Popen[bytes],
                       placed: list[Host], size: int) -> str:
        """In-process mode: count the resets (inprocess.Losses) and each lost rank against its host while the survivors
        recover by themselves; stop the job ("" while it goes on) past --reset-limit or below --min-np survivors."""
        limit = self.args.reset_limit
        snapshot = server.snapshot()
        losses.note_recoveries(snapshot)
        for silent, started, why in losses.to_fence(snapshot, time.monotonic()):
            inprocess.fence(logger, silent, started, why, hosts_by_rank(placed, size), self._command_on)
        if losses.before + losses.resets > self.resets:  # lost ranks the driver had counted as one recovery
            if not self._within_limit(losses, proc):  # were recovered from one after the other
                return "the survivors recovered from ranks lost together one after the other"
            logger.info("reset %d%s: the survivors recovered from the ranks lost together in two steps (%d ranks left)",
                        self.resets, f" of {limit}" if limit is not None else "", losses.alive)
        for lost in losses.new(snapshot):
            standing = self._failed_on(placed, size, lost)
            if "blacklisted" in standing:
                logger.info("%s", standing)
            outcome = f"rank {lost.rank} on host {lost.host} (pid {lost.pid}) failed"
            joined = losses.before + losses.resets == self.resets
            if not joined and not self._within_limit(losses, proc):
                return outcome
            if losses.alive < self.min_np:
                self._stop(proc)
                self.resets -= 1  # the reset under way (counted above) is the restart, which _loop counts
                return (f"{outcome}; {losses.alive} rank(s) left, below --min-np {self.min_np}: in-process mode cannot "
                        f"add ranks to a running job (Open MPI 5.0 cannot grow it safely: docs/elastic.md, Growth), so "
                        f"the job starts again from its last commit once {self.min_np} slots are usable")
            inprocess.report(logger, lost, losses, self.resets, limit, joined)
        return ""

    def _failed_on(self, placed: list[Host], size: int, lost: RankInfo, remove: bool = False) -> str:
        """Count ``lost`` against its host (as the driver placed it: the rank reports its hostname), which is
        blacklisted when it fails repeatedly (``remove``: its commits there are then deleted); say what it did."""
        placement = hosts_by_rank(placed, size)
        host = placement[lost.rank] if lost.rank < len(placement) else lost.host
        failures, seconds = self.blacklist.failed(host)
        if remove and seconds is not None:
            self.remover.remove_on(host)
        return describe_failure(host, failures, seconds)

    def _within_limit(self, losses: inprocess.Losses, proc: subprocess.Popen[bytes]) -> bool:
        """Count the resets ``losses`` now needs; past --reset-limit stop the job instead (False: _loop says so)."""
        needed, limit = losses.before + losses.resets, self.args.reset_limit
        if limit is not None and needed > limit:
            self.resets = needed - 1
            self._stop(proc)
            return False
        self.resets = needed
        return True

    def _hosts_changed(self, server: DriverServer, started_on: list[Host]) -> bool:
        try:
            now = self.usable_hosts()
        except DiscoveryError as exc:
            logger.warning("%s", exc)
            return False
        if sorted(map(str, now)) == sorted(map(str, started_on)):
            return False
        if total_slots(now) < self.min_np:  # no resize could start: the ranks train on until one could
            if now != self.short_listing:  # (a listing caught half-written, a host between two jobs)
                logger.warning("discovery lists %s: fewer than --min-np %d slots; the running ranks go on as "
                               "they are", ",".join(map(str, now)) or "no host", self.min_np)
            self.short_listing = now
            return False
        added = sorted({h.name for h in now} - {h.name for h in started_on})
        removed = sorted({h.name for h in started_on} - {h.name for h in now})
        if self.standby.hold_growth(now, self.max_np, server):  # (the handover: docs/elastic.md, "Growth")
            return False
        generation = server.bump_generation()
        if added:
            self.added = inprocess.Added(tuple(added), time.monotonic())
        logger.info("hosts changed (added: %s; removed: %s; now %s): generation %d, the ranks resize at their "
                    "next commit%s", ",".join(added) or "none", ",".join(removed) or "none",
                    ",".join(map(str, now)) or "none", generation,
                    "" if added or removed else f" (from {','.join(map(str, started_on))}: slots usable again)")
        return True

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM if self.srun else signal.SIGINT)  # (nothing if it has exited)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()


def run_elastic(args: argparse.Namespace, env: Mapping[str, str], plan_launch: Any) -> int:
    """Entry point from hvdlite-run's main when an elastic flag is given."""
    try:
        return ElasticDriver(args, env, plan_launch).run()
    except (HostSpecError, LaunchError, DiscoveryError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
