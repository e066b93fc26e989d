"""Fencing: end the process of a rank the job has given up on (stopped, or wedged), so it cannot hold the job."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
from typing import Callable, Optional, Sequence

if __package__:
    from .log import logger
else:  # run by path on a rank's host, for the elastic driver (fence_command): the standard library only
    import logging
    logger = logging.getLogger("hvdlite")


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where one rank's process runs: host, pid, and start time (clock ticks after boot; 0 where unknown), which
    tells the process from a later one that got its pid."""

    host: str
    pid: int
    started: int


def this_process() -> Peer:
    return Peer(socket.gethostname(), os.getpid(), start_ticks(os.getpid()))


def start_ticks(pid: int, stopped: bool = False) -> int:
    """Start ticks of process ``pid`` (/proc); 0 when gone, a zombie or unknown, or (``stopped``) not in state T."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
        fields = text[text.rindex(b")") + 2:].split()  # [state, ppid, ...] after the name (which may hold spaces)
    except (OSError, ValueError):
        return 0
    return int(fields[19]) if len(fields) > 19 and (fields[0] == b"T" if stopped else fields[0] != b"Z") else 0


def fence(ranks: Sequence[int], peers: Sequence[Peer], why: str, then: str, stopped_only: bool = False) -> list[int]:
    """SIGKILL the processes of ``ranks`` on this host that are still those that joined the job (``stopped_only``:
    only those stopped by SIGSTOP, state T; a debugger's stop is t); return those ranks."""
    here = socket.gethostname()
    killed = []
    for rank in ranks:
        peer = peers[rank]
        if peer.host != here or peer.pid == os.getpid() or stopped_only and not start_ticks(peer.pid, stopped=True) or \
                not kill_if_same(peer.pid, peer.started):
            continue  # another host's, this one, a running one, or gone already (its pid may be another's by now)
        logger.warning("rank %d (host %s, pid %d) %s: killed it (SIGKILL), %s", rank, peer.host, peer.pid, why, then)
        killed.append(rank)
    return killed


#: Who ends silent ranks on other hosts: the elastic driver's link sets it (core/elastic/link.py), None without one.
elsewhere: Optional[Callable[[Sequence[int], Sequence[Peer], str], None]] = None


def fence_elsewhere(ranks: Sequence[int], peers: Sequence[Peer], why: str) -> None:
    """Have the processes of ``ranks`` on other hosts ended there, where someone can."""
    if elsewhere is not None:
        elsewhere(ranks, peers, why)


def kill_if_same(pid: int, started: int) -> bool:
    """SIGKILL process ``pid`` if it is still the one that started at ``started``; whether it was killed."""
    if not started or start_ticks(pid) != started:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def fence_command(python: str, pid: int, started: int) -> list[str]:
    """The command that runs kill_if_same on the host it is started on (the standard library only)."""
    return [python, "-I", "-S", os.path.abspath(__file__), str(pid), str(started)]


if __name__ == "__main__":
    _pid, _started = int(sys.argv[1]), int(sys.argv[2])
    _done = "killed it (SIGKILL)" if kill_if_same(_pid, _started) else "it was gone already"
    logging.basicConfig(stream=sys.stderr, format=f"hvdlite-run: host {socket.gethostname()}: %(message)s")
    logger.warning("fencing pid %d: %s", _pid, _done)
