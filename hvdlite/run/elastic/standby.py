"""The standby job: the run's next full-size MPI job, started before a regrowth needs it; its ranks start the program
and wait at hvd.elastic.run's connect until the driver hands the run over to them (docs/elastic.md, "Growth")."""
from __future__ import annotations

import logging
import subprocess
import time
from typing import Callable, Optional

from ..hosts import Host, total_slots
from .discovery import assign
from .server import DriverServer

#: Seconds a regrowth waits for a standby job still starting; after FAILURES dropped (or ended), no more standbys.
READY_WAIT_S, FAILURES = 120.0, 3


class Standby:
    """In-process mode with a discovery script, once the run lost a rank: one standby job for the full size of the
    listing, so that growing back costs the handover, not the program's start (imports, MPI_Init, the model)."""

    def __init__(self, log: logging.Logger,
                 launch: Callable[[list[Host], DriverServer, bool], subprocess.Popen[bytes]],
                 stop: Callable[[subprocess.Popen[bytes]], None]) -> None:
        self.log, self.launch, self.stop = log, launch, stop
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.placed: list[Host] = []
        self.started_at, self.failures = 0.0, 0

    def tend(self, wanted: bool, listing: list[Host], max_np: int, server: DriverServer) -> None:
        """Start one for the full size of ``listing`` when ``wanted`` and there is none; drop one that ended."""
        if self.proc is not None and self.proc.poll() is not None:
            self._failed(f"the standby job ended (exit code {self.proc.returncode}) before its handover")
        if wanted and self.proc is None and self.failures < FAILURES:
            self.placed, self.started_at = assign(listing, min(max_np, total_slots(listing))), time.monotonic()
            self.proc = self.launch(self.placed, server, True)
            self.log.info("standby: started %d ranks on %s for the next regrowth (they wait at hvd.elastic.run)",
                          total_slots(self.placed), ",".join(map(str, self.placed)))

    def ready(self, placed: list[Host], server: DriverServer) -> bool:
        """It runs on ``placed``, and every rank of it waits on ``server`` (a new endpoint: none)."""
        return (self.proc is not None and self.proc.poll() is None and placed == self.placed
                and server.standing_by() == total_slots(placed))

    def hold_growth(self, listing: list[Host], max_np: int, server: DriverServer) -> bool:
        """Whether a regrowth to ``listing`` waits: its standby job is still starting (up to READY_WAIT_S)."""
        placed = assign(listing, min(max_np, total_slots(listing)))
        if self.proc is None or placed != self.placed or self.ready(placed, server):
            return False
        if time.monotonic() - self.started_at < READY_WAIT_S:
            return True
        self._failed(f"the standby job's ranks were not all waiting {READY_WAIT_S:.0f} s after its start")
        return False

    def take(self, placed: list[Host], server: DriverServer) -> Optional[subprocess.Popen[bytes]]:
        """Its launcher's process when it is ready for the job about to start on ``placed`` (the caller then releases
        its ranks: DriverServer.release); else None, and the standby job, if any, is ended."""
        if not self.ready(placed, server):
            self.discard()
        proc, self.proc = self.proc, None
        return proc

    def discard(self) -> None:
        if self.proc is not None:
            self.stop(self.proc)
        self.proc = None

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.log.warning("%s%s", why, "; the run grows through fresh starts from now on" if self.failures >= FAILURES
                         else f" (failure {self.failures} of {FAILURES}): dropped, another one starts")
        self.discard()
