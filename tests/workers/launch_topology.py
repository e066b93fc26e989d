"""Launch-test worker: report this rank's hvdlite topology and host, check an allreduce, print one JSON line.

Rank 0 prints ``HVDLITE_TOPOLOGY <json list, one entry per rank>``. Options:
  --env NAMES        comma-separated variables each rank reports (to check -x / --env)
  --bytes N          also allreduce N bytes of float32 and report the interface's rx/tx byte counters
                     before and after it (``--iface``, read from /sys/class/net of this host), then N bytes
                     in place (``big_inplace_ok``: exact)
  --exit-code K      after reporting, rank ``--exit-rank`` exits with code K (others exit 0)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np

import hvdlite as hvd


def counters(iface: str) -> dict[str, int]:
    stats = Path("/sys/class/net") / iface / "statistics"
    return {name: int((stats / f"{name}_bytes").read_text()) for name in ("rx", "tx")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="")
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--iface", default="hvd0")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--exit-rank", type=int, default=1)
    opts = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    info: dict[str, object] = {
        "rank": rank, "size": size, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "host": socket.gethostname(),
        "pid": os.getpid(), "slurm_procid": os.environ.get("SLURM_PROCID"), "executable": sys.executable,
        "env": {name: os.environ.get(name) for name in filter(None, opts.env.split(","))},
    }
    total = hvd.allreduce(np.full(3, rank + 1, dtype=np.float64), op=hvd.Sum, name="topology.sum")
    top = np.array([rank + 1.0])  # under Open MPI at 4+ ranks both are a reduce and a broadcast (chunks.py)
    hvd.allreduce_(top, op=hvd.Max, name="topology.max")
    info["allreduce_ok"] = bool(np.array_equal(total, np.full(3, size * (size + 1) / 2)) and top[0] == size)
    if opts.bytes:
        count = opts.bytes // 4
        data = np.full(count, float(rank + 1), dtype=np.float32)
        hvd.barrier()
        before = counters(opts.iface)
        result = hvd.allreduce(data, op=hvd.Sum, name="topology.big")
        hvd.barrier()
        after = counters(opts.iface)
        info["big_ok"] = bool(result[0] == size * (size + 1) / 2 and result[-1] == result[0])
        info["link"] = {key: after[key] - before[key] for key in after}
        ramp = (np.arange(count) % 1000).astype(np.float32)  # in place too (MPI_IN_PLACE), exact sums
        mine = ramp + rank
        hvd.allreduce_(mine, op=hvd.Sum, name="topology.big.inplace")
        info["big_inplace_ok"] = bool(np.array_equal(mine, ramp * size + size * (size - 1) / 2))
    everyone = hvd.allgather_object(info, name="topology.report")
    if rank == 0:
        print("HVDLITE_TOPOLOGY " + json.dumps(everyone), flush=True)
    hvd.barrier()
    hvd.shutdown()
    return opts.exit_code if rank == opts.exit_rank else 0


if __name__ == "__main__":
    sys.exit(main())
