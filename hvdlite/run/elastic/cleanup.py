"""Delete an elastic run's commits on the hosts its ranks ran on, in the background, within a time limit each."""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import threading
from typing import Callable, Iterable, Mapping, Optional, Sequence

from hvdlite.core.launch import Config, job_dir, remove_job, remover_command

from ..commands import format_command
from ..hosts import Host, HostSpecError
from ..launchers import LaunchError
from ..process import kill_group
from .server import is_local

#: Seconds a host gets to delete its commits (reach it, start Python, delete) before the attempt is given up.
REMOVE_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Removal:
    """One host's deletion in flight: the launcher process that runs it there, and the thread that waits for it."""

    proc: subprocess.Popen[bytes]
    thread: threading.Thread


class CommitRemover:
    """Runs one command per host (the launcher starting the deletion on that host: ``command_on``), never waiting
    longer than ``timeout_s`` for any of them; a failure is one warning naming the host and the directory."""

    def __init__(self, log: logging.Logger, timeout_s: float = REMOVE_TIMEOUT_S, job: str = "",
                 env: Optional[Mapping[str, str]] = None,
                 command_on: Optional[Callable[[str, list[str]], tuple[list[str], dict[str, str]]]] = None,
                 verbose: bool = False) -> None:
        self.log, self.timeout_s = log, timeout_s
        self.pending: dict[str, Removal] = {}
        self.job, self.env, self.command_on, self.verbose = job, dict(env or {}), command_on, verbose
        self.ran_on: dict[str, Host] = {}  # hosts whose ranks may have left commits there since deleted

    def commit_dir(self) -> Optional[str]:
        try:
            return Config.from_env(self.env).elastic_commit_dir
        except (ValueError, TypeError) as exc:
            self.log.warning("elastic commits not removed: %s", exc)
            return None

    def remove_all(self) -> None:
        """The run is over: delete the copy of each host whose ranks did not (remove_on, at most ``timeout_s``), and
        what this machine's file system holds (every host's copy where the hosts share it)."""
        try:
            for name in list(self.ran_on):
                self.remove_on(name)
            self.wait()
        finally:
            configured = self.commit_dir()
            if configured is not None:
                remove_job(configured, self.job)

    def remove_on(self, name: str) -> None:
        """Start deleting this run's commit on host ``name`` (blacklisted, dropped by discovery, or at the end)
        through the launcher, in the background (this machine's copies go when the run ends: remove_all)."""
        host = self.ran_on.pop(name, None)
        configured = self.commit_dir()
        if host is None or is_local(name) or configured is None or self.command_on is None:
            return
        where = str(job_dir(configured, self.job))
        try:
            cmd, env = self.command_on(name, remover_command(sys.executable, configured, self.job))
        except (HostSpecError, LaunchError, ValueError) as exc:
            self.failed(name, where, str(exc))
            return
        if self.verbose:
            self.log.info("deleting the commits on %s: %s", name, format_command(cmd, {}))
        self.start(name, cmd, env, where)

    def start(self, host: str, cmd: Sequence[str], env: Mapping[str, str], where: str) -> None:
        """Start deleting on ``host`` (after its deletion still in flight, if any, is over)."""
        self.wait([host])
        try:
            proc = subprocess.Popen(list(cmd), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self.failed(host, where, f"cannot start {cmd[0]}: {exc.strerror}")
            return
        thread = threading.Thread(target=self._finish, args=(host, where, proc), daemon=True)
        self.pending[host] = Removal(proc, thread)
        thread.start()

    def _finish(self, host: str, where: str, proc: subprocess.Popen[bytes]) -> None:
        """Wait for one deletion, at most ``timeout_s`` (then its launcher is ended), and say how it failed."""
        try:
            output = proc.communicate(timeout=self.timeout_s)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            self.failed(host, where, f"no answer within {self.timeout_s:.0f} s")
            return
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
        if proc.returncode != 0:
            self.failed(host, where, f"exit code {proc.returncode}" + (f": {last[:300]}" if last else ""))

    def failed(self, host: str, where: str, why: str) -> None:
        self.log.warning("could not delete the elastic commits on host %s (%s); delete %s there by hand",
                         host, why, shlex.quote(where))

    def poll(self) -> None:
        """Forget the deletions that are over."""
        self.pending = {host: removal for host, removal in self.pending.items() if removal.thread.is_alive()}

    def wait(self, hosts: Optional[Iterable[str]] = None) -> None:
        """Wait for the deletions on ``hosts`` (default: all), each at most until its time limit."""
        wanted = [host for host in (list(self.pending) if hosts is None else hosts) if host in self.pending]
        try:
            for host in wanted:
                self.pending[host].thread.join()
                del self.pending[host]
        finally:
            for host in wanted:  # interrupted (a second Ctrl-C): leave no launcher behind
                if host in self.pending and self.pending[host].proc.poll() is None:
                    kill_group(self.pending[host].proc.pid)


#: Where MPICH keeps a job's shared memory on a host, and the prefix of its files: a rank killed during MPI_Init
#: leaves its job's file (1-4 MB) behind, which nothing deletes (the restart path under MPICH, issue 48).
SHM_DIR = "/dev/shm"
SHM_PREFIX = "mpich_shm_"


def shm_files(directory: str = SHM_DIR) -> set[str]:
    """The MPICH shared-memory files in ``directory`` now."""
    try:
        return {os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def remove_leftover_shm(before: set[str], directory: str = SHM_DIR) -> list[str]:
    """Delete the MPICH shared-memory files that appeared in ``directory`` since ``before`` was taken and that no
    process on this machine maps any more (a job running beside ours maps its own); return those deleted."""
    new = shm_files(directory) - before
    if not new:
        return []
    mapped: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                mapped.update(line.split(None, 5)[5].strip() for line in maps if SHM_PREFIX in line)
        except (OSError, IndexError):
            continue
    removed = []
    for path in sorted(new - mapped):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
