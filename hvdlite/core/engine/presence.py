"""Presence probes: naming the ranks that stopped answering when a negotiation round never completes.

A round completes only when every engine of it takes part: a stopped or GIL-wedged rank holds it, unseen by the
stall inspector. A waiting engine answers probes; past ``stall_shutdown_time_seconds`` it probes every peer
itself, point-to-point on its own communicator: those that do not answer within the grace period hold the job.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from . import mpi

_PROBE, _REPLY = 0x7E01, 0x7E02
GRACE_S = 2.0  # how long a prober waits for answers (answering takes one poll of a waiting engine)


class Presence:
    """Answers peers' probes, and probes peers. Used only by the engine thread."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._ids = itertools.count(1)
        self._sends: list[Any] = []
        self._status = mpi.status()
        self._box = np.zeros(1, dtype=np.int64)

    def serve(self) -> None:
        """Answer every probe that has arrived (cheap when none has: one Iprobe)."""
        while self.comm.Iprobe(source=mpi.ANY_SOURCE(), tag=_PROBE, status=self._status):
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
