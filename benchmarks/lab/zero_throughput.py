"""Training throughput: hvd.ZeroRedundancyOptimizer vs hvd.DistributedOptimizer vs torch's ZeroRedundancyOptimizer.

    mpiexec -n 2 python benchmarks/lab/zero_throughput.py --out benchmarks/results/zero_throughput.json   # ~2 min

The small BERT-style transformer of train_throughput.py (4 layers, width 256, sequence 64, batch 16 per rank)
trained with AdamW on synthetic data three ways in one job, interleaved (one round of ``--steps`` steps of
each method per repetition): hvdlite's DistributedOptimizer, hvdlite's ZeroRedundancyOptimizer, and torch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` with DDP over gloo (torch.distributed initialised with
the MPI rank and size; torch's sharded optimizer needs DDP to average the gradients). Rank 0 prints JSON
lines: samples/s per method (median over rounds, slowest rank) and the ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import Output, Series, init_gloo, machine_info, summarize, timed  # noqa: E402
from shapes import small_transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdlite.torch as hvd

    comm = MPI.COMM_WORLD
    hvd.init()
    init_gloo(comm)
    n = hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    out = Output(hvd.rank(), args.out)
    out.emit(machine_info("zero_throughput", n, batch=args.batch_size, seq=args.seq, steps=args.steps))

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return small_transformer()

    methods = {}
    m = make()
    methods["hvdlite_distributed"] = (m, hvd.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-4),
                                                                  named_parameters=m.named_parameters()))
    m = make()
    methods["hvdlite_zero"] = (m, hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4))
    m = make()
    ddp = DDP(m)
    methods["torch_zero_ddp_gloo"] = (ddp, TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4))

    gen = torch.Generator().manual_seed(hvd.rank())
    ids = torch.randint(0, 16000, (args.batch_size, args.seq), generator=gen)
    labels = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for _ in range(args.steps):
            opt.zero_grad()
            F.cross_entropy(model(ids), labels).backward()
            opt.step()

    series = {name: Series(name) for name in methods}
    for r in range(args.warmup + args.rounds):
        for name, (model, opt) in methods.items():
            seconds = timed(comm, lambda: run(model, opt))
            if r >= args.warmup:
                series[name].times.append(seconds)
    rates = {}
    for name, s in series.items():
        summary = summarize(comm, s)
        rates[name] = args.steps * args.batch_size * n / (summary["ms"] / 1e3)
        out.emit({"bench": "zero_throughput", "method": name, "ranks": n, "samples_per_s": round(rates[name], 2),
                  **{k: round(v, 1) for k, v in summary.items()}})
    out.emit({"bench": "zero_throughput", "kind": "summary", "ranks": n,
              "zero_vs_distributed": round(rates["hvdlite_zero"] / rates["hvdlite_distributed"], 3),
              "zero_vs_torch_zero": round(rates["hvdlite_zero"] / rates["torch_zero_ddp_gloo"], 3),
              "overlap": methods["hvdlite_zero"][1].overlap})
    out.close()
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
