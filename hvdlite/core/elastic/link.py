"""The rank's side of the connection to the elastic driver (hvdlite-run): hello, host-change queries, reports; one
signed TCP connection a rank for its whole life (docs/elastic.md, "Who may talk to the driver")."""
from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any, Optional, Sequence

from ..config import getenv
from ..elastic_wire import (DRIVER_VARIABLE, GENERATION_VARIABLE, RESTART_VARIABLE, SECRET_VARIABLE, STANDBY_VARIABLE,
                            signature)
from .. import fencing
from ..launch_check import int_or_none
from ..log import logger

CONNECT_TIMEOUT_S = 30.0


class DriverLink:
    """One rank's connection to the driver; every method is a no-op when there is no driver."""

    def __init__(self) -> None:
        self.address = getenv(DRIVER_VARIABLE) or ""
        self._sock: Optional[socket.socket] = None
        self._reader: Any = None
        self._nonce, self._seq = "", 0
        self._sending = threading.Lock()  # the engine thread sends too (ask_to_end), besides the training thread
        self.generation = 0
        self.restart = number(RESTART_VARIABLE)  # the driver's restarts of the job (a standby's: at its handover)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def connect(self, rank: int, size: int) -> None:
        """Say hello (rank, size, host, pid) and learn the current host generation."""
        if not self.enabled or self._sock is not None:
            return
        if not getenv(SECRET_VARIABLE):
            raise ConnectionError(f"rank {rank}: {DRIVER_VARIABLE} is set but {SECRET_VARIABLE} is not: only the "
                                  f"processes hvdlite-run's elastic driver starts may talk to it; start the job "
                                  f"with hvdlite-run (or unset {DRIVER_VARIABLE})")
        host, _, port = self.address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            self._reader = self._sock.makefile("r", encoding="utf-8")
            self._nonce = str(json.loads(self._reader.readline() or "{}")["nonce"])  # the driver speaks first
        except (OSError, ValueError, KeyError) as exc:
            self.close()
            raise ConnectionError(f"rank {rank}: cannot reach the elastic driver at {self.address} "
                                  f"({exc!r}); is hvdlite-run still running there, and is the port reachable "
                                  f"from this host?") from None
        self._sock.settimeout(None)
        self._seq = 0
        fencing.elsewhere = self.ask_to_end
        # the generation the driver started this job with: a change before the ranks connected counts too
        self.generation = number(GENERATION_VARIABLE)
        if getenv(STANDBY_VARIABLE):  # a standby job's rank: wait until the driver hands the run over to this job,
            self.send(op="standby", rank=rank, size=size)  # then go on with that moment's restart and generation
            handover = self._answer(f" before handing the run over to this standby job's rank {rank}")
            self.restart, self.generation = int(handover["restart"]), int(handover["generation"])
        self.send(op="hello", rank=rank, size=size, host=socket.gethostname(), pid=os.getpid(), attempt=self.restart)

    def send(self, **message: Any) -> bool:
        """Send one signed message; whether it went (False: no driver, or the connection is gone)."""
        with self._sending:  # one sequence number per message, in the order the driver reads them
            if self._sock is None:
                return False
            self._seq += 1
            message["seq"] = self._seq
            message["mac"] = signature(getenv(SECRET_VARIABLE) or "", self._nonce, message)
            try:
                self._sock.sendall((json.dumps(message) + "\n").encode())
            except OSError as exc:
                logger.warning("lost the connection to the elastic driver (%s)", exc)
                return False
            return True

    def ask_to_end(self, ranks: Sequence[int], peers: Sequence[fencing.Peer], why: str) -> None:
        """The stall inspector's verdict on ``ranks`` (fencing.fence_elsewhere): ask the driver to end those on
        other hosts (a rank alone on its host has no survivor there to end it)."""
        here = socket.gethostname()
        elsewhere = [rank for rank in ranks if peers[rank].host != here and peers[rank].started]
        if not elsewhere:
            return
        if self.send(op="silent", peers=[[peers[r].host, peers[r].pid, peers[r].started] for r in elsewhere]):
            logger.warning("rank(s) %s (host(s) %s) %s: asked hvdlite-run's elastic driver to end them on their "
                           "hosts, so that MPI sees them as failed and the survivors recover without them",
                           elsewhere, ", ".join(sorted({peers[r].host for r in elsewhere})), why)

    def current_generation(self) -> int:
        """The driver's host generation (it goes up each time the usable hosts change)."""
        if self._sock is None:
            return 0
        self.send(op="generation")
        return int(self._answer("")["generation"])

    def _answer(self, when: str) -> dict[str, Any]:
        line = self._reader.readline()
        if not line:
            raise ConnectionError(f"the elastic driver at {self.address} closed the connection{when}")
        return dict(json.loads(line))

    def close(self) -> None:
        fencing.elsewhere = None
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


_link: Optional[DriverLink] = None


def link() -> DriverLink:
    """This process's driver link (created on first use)."""
    global _link
    if _link is None:
        _link = DriverLink()
    return _link


def number(variable: str) -> int:
    """A number the elastic driver sets in its ranks (0 outside one): RESTART_VARIABLE (how many times it restarted
    the job), GENERATION_VARIABLE, MIN_NP_VARIABLE (--min-np)."""
    return int_or_none(getenv(variable)) or 0
