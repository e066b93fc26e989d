"""hvdlite's two data planes for torch CPU tensors on ResNet-50's gradients: the MPI engine path (default) against
torch.distributed's gloo plane (HOROVOD_CPU_OPERATIONS=GLOO), both through hvd.allreduce_async_ per tensor
(reverse order, as backward produces them) and synchronize, as DistributedOptimizer does.

Run:   mpiexec -n 2 python benchmarks/lab/gloo_vs_mpi.py [--reps 10] [--rounds 3] [--scale 1.0]

The planes alternate (hvd.init(cpu_operations=...) per phase, --rounds phases each), so load from elsewhere hits
both alike. Each repetition starts with a barrier; its time is the slowest rank's; figures are medians.
Prints one JSON line: ms per plane and gloo / mpi (above 1: the MPI path is faster).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common  # noqa: E402
from shapes import gradient_shapes  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="shrink every tensor to this fraction (smoke runs)")
    args = p.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    shapes = gradient_shapes("resnet50")
    grads = [torch.randn(max(1, int(math.prod(s) * args.scale))) for s in reversed(shapes)]
    times: dict[str, list[float]] = {"mpi": [], "gloo": []}

    def step() -> None:
        handles = [hvd.allreduce_async_(g, name=f"g{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    for _ in range(args.rounds):
        for plane in ("mpi", "gloo"):
            hvd.init(cpu_operations=plane)
            assert hvd.gloo_enabled() is (plane == "gloo")
            step()  # warm-up (and the gloo plane's connections)
            series = _common.Series(plane)
            for _ in range(args.reps):
                series.times.append(_common.timed(comm, step))
            times[plane].append(_common.summarize(comm, series)["ms"])
            hvd.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    if comm.Get_rank() == 0:
        print(json.dumps({
            **_common.machine_info("gloo_vs_mpi", comm.Get_size(), tensors=len(grads),
                                   floats=sum(g.numel() for g in grads)),
            "mpi_ms": round(med["mpi"], 2), "gloo_ms": round(med["gloo"], 2),
            "gloo_over_mpi": round(med["gloo"] / med["mpi"], 3),
            "phases_ms": {k: [round(t, 2) for t in v] for k, v in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
