"""The machine's own scaling limit: N ranks train independent copies at once (no communication) against one alone.

Run:   mpiexec -n 2 python benchmarks/lab/hw_scaling.py [--out benchmarks/results/hw_scaling.json]
Smoke: mpiexec -n 2 python benchmarks/lab/hw_scaling.py --tiny --steps 1 --rounds 1

Same models, batch and threads per rank as train_throughput.py. Rank 0 times its steps alone (the others wait),
then every rank at once; "efficiency" = alone / together is the best scaling efficiency any data-parallel
library can reach on this machine before communicating at all. One JSON line per model (median of rounds).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,transformer")
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (median reported)")
    p.add_argument("--tiny", action="store_true", help="tiny models, for smoke tests")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import torch
    from torch.nn import functional as F
    from mpi4py import MPI
    from shapes import Bert, ResNet, small_transformer
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = max(1, (os.cpu_count() or 1) // size)  # as train_throughput.py: cores // ranks
    torch.set_num_threads(threads)
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("hw_scaling", size, steps=args.steps, rounds=args.rounds, threads=threads))
    for name in [m for m in args.models.split(",") if m]:
        torch.manual_seed(0)
        if name == "resnet50":
            model = ResNet(blocks=(1, 1, 1, 1), base_width=8, num_classes=10) if args.tiny else ResNet(num_classes=10)
            x = torch.randn(16, 3, 16 if args.tiny else 64, 16 if args.tiny else 64)
        else:
            model = Bert(vocab=500, hidden=32, layers=1, heads=2, intermediate=64, max_positions=16,
                         num_classes=10) if args.tiny else small_transformer(10)
            x = torch.randint(0, 500 if args.tiny else 16000, (16, 8 if args.tiny else 64))
        y = torch.randint(0, 10, (16,))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def steps() -> float:
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            return (time.perf_counter() - start) / args.steps

        steps()  # warm-up
        alone, together = [], []
        for _ in range(args.rounds):
            comm.Barrier()
            if rank == 0:
                alone.append(steps())
            comm.Barrier()
            together.append(comm.allreduce(steps(), op=MPI.MAX))
        a, t = sorted(alone)[len(alone) // 2] if alone else 0.0, sorted(together)[len(together) // 2]
        if rank == 0:
            output.emit({"bench": "hw_scaling", "model": name, "ranks": size, "alone_ms": a * 1e3,
                         "together_ms": t * 1e3, "efficiency": a / t})
    output.close()


if __name__ == "__main__":
    main()
