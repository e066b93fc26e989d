"""Delete an elastic run's commits on other hosts in the background, each within a time limit, logging failures."""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import subprocess
import tempfile
import time
from typing import IO, Iterable, Mapping, Optional, Sequence

from ..process import kill_group

#: Seconds a host gets to delete its commits (reach it, start Python, delete) before the attempt is given up.
REMOVE_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Removal:
    """One host's deletion in flight: the launcher process that runs it there, and where its output goes."""

    host: str
    where: str  # the directory to delete by hand if this fails
    proc: subprocess.Popen[bytes]
    output: IO[bytes]
    started: float


class CommitRemover:
    """Runs one command per host (the launcher starting the deletion on that host), never waiting longer
    than ``timeout_s`` for any of them; a failure is one warning naming the host and the directory."""

    def __init__(self, log: logging.Logger, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
        self.log = log
        self.timeout_s = timeout_s
        self.pending: dict[str, Removal] = {}

    def start(self, host: str, cmd: Sequence[str], env: Mapping[str, str], where: str) -> None:
        """Start deleting on ``host`` (after its deletion still in flight, if any, is over)."""
        self.wait([host])
        output = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(list(cmd), env=dict(env), stdin=subprocess.DEVNULL, stdout=output,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            output.close()
            self.failed(host, where, f"cannot start {cmd[0]}: {exc.strerror}")
            return
        self.pending[host] = Removal(host, where, proc, output, time.monotonic())

    def failed(self, host: str, where: str, why: str) -> None:
        self.log.warning("could not delete the elastic commits on host %s (%s); delete %s there by hand",
                         host, why, shlex.quote(where))

    def poll(self) -> None:
        """Collect the deletions that are over or out of time."""
        for host in list(self.pending):
            self._check(self.pending[host], time.monotonic())

    def wait(self, hosts: Optional[Iterable[str]] = None) -> None:
        """Wait for the deletions on ``hosts`` (default: all), each at most until its time limit."""
        wanted = [self.pending[h] for h in (self.pending if hosts is None else hosts) if h in self.pending]
        try:
            for removal in wanted:
                left = removal.started + self.timeout_s - time.monotonic()
                try:
                    removal.proc.wait(timeout=max(left, 0.0))
                except subprocess.TimeoutExpired:
                    pass
                self._check(removal, time.monotonic())
        finally:
            for removal in wanted:  # interrupted (a second Ctrl-C): leave no launcher behind
                if removal.host in self.pending and removal.proc.poll() is None:
                    kill_group(removal.proc.pid)

    def _check(self, removal: Removal, now: float) -> None:
        code = removal.proc.poll()
        late = code is None and now - removal.started >= self.timeout_s
        if code is None and not late:
            return
        del self.pending[removal.host]
        if late:
            kill_group(removal.proc.pid)
            removal.proc.wait()
        removal.output.seek(0)
        lines = [line.strip() for line in removal.output.read().decode(errors="replace").splitlines()]
        removal.output.close()
        last = next((line for line in reversed(lines) if line), "")
        if late:
            self.failed(removal.host, removal.where, f"no answer within {self.timeout_s:.0f} s")
        elif code != 0:
            self.failed(removal.host, removal.where, f"exit code {code}" + (f": {last[:300]}" if last else ""))


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
