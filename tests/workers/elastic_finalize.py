"""A rank of an elastic job under ULFM that never recovered still ends MPI within the finalize limit
(hvdlite/core/recovery.py, finalize_at_exit), for tests/test_elastic_stops.py.

``LIMIT LINGER``: the limit (set here, the test's knob; 60 s otherwise); after hvd.elastic.run's training (run twice:
its exit handler, registered once, runs once: ``finalize_at_exit rank=R call=1``) the last rank stays LINGER s
outside MPI before it exits, while the others' MPI_Finalize (Open MPI 5's fault-tolerant one, a shrink and a barrier
among every rank) waits for it.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import hvdlite as hvd
from hvdlite.core import recovery


def main() -> None:
    limit, linger = float(sys.argv[1]), float(sys.argv[2])
    recovery.FINALIZE_TIMEOUT_S = limit
    hvd.init()

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> float:
        return float(hvd.allreduce(np.ones(2), op=hvd.Sum)[0])

    rank, finalize, calls = hvd.rank(), recovery.finalize_at_exit, []

    def counted(timeout_s: float) -> None:  # (hvd.elastic.run registers recovery.finalize_at_exit, looked up then)
        calls.append(timeout_s)
        print(f"finalize_at_exit rank={rank} call={len(calls)}", flush=True)
        finalize(timeout_s)
    recovery.finalize_at_exit = counted
    state = hvd.elastic.ObjectState(step=0)
    total = train(state) + train(state)  # (the second call must not register the exit handler again)
    print(f"trained rank={rank} total={total:g} t={time.time():.6f}", flush=True)
    if rank == hvd.size() - 1:
        hvd.shutdown()
        time.sleep(linger)
    print(f"exiting rank={rank} t={time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
