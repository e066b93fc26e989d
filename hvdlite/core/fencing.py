"""Fencing: end the process of a rank the job has given up on (stopped, or wedged), so it cannot hold the job."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
from typing import Sequence

from .log import logger

__all__ = ["Peer", "fence", "this_process"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where one rank's process runs: its host, pid, and start time (clock ticks after boot, from /proc; 0
    where unknown), which tells the process from a later one that got its pid."""

    host: str
    pid: int
    started: int


def this_process() -> Peer:
    return Peer(socket.gethostname(), os.getpid(), _start_ticks(os.getpid()))


def _start_ticks(pid: int) -> int:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat); 0 when it is gone, a zombie, or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
        fields = text[text.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
        return 0 if fields[0] == b"Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return 0


def fence(ranks: Sequence[int], peers: Sequence[Peer], why: str, then: str) -> list[int]:
    """Kill (SIGKILL: a stopped process dies too) the processes of ``ranks`` that run on this host and are still
    the processes that joined the job; return those ranks. Ranks on other hosts are left to survivors there."""
    here = socket.gethostname()
    killed = []
    for rank in ranks:
        peer = peers[rank]
        if peer.host != here or peer.pid == os.getpid() or not peer.started:
            continue
        if _start_ticks(peer.pid) != peer.started:
            continue  # already gone (its pid may belong to another process by now)
        try:
            os.kill(peer.pid, signal.SIGKILL)
        except OSError:
            continue
        logger.warning("rank %d (host %s, pid %d) %s: killed it (SIGKILL), %s", rank, peer.host, peer.pid, why, then)
        killed.append(rank)
    return killed
