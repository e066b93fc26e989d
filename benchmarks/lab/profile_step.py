"""Where a training step's time goes: per-phase wall time and CPU seconds per thread, hvdlite against DDP.

Run: mpiexec -n 2 python benchmarks/lab/profile_step.py [--model resnet50|transformer] [--rounds 8]

Methods, interleaved step by step (one model replica each, same data):
  single       one process, no communication (rank 0 alone; the other ranks wait without spinning)
  hvdlite      hvdlite.torch DistributedOptimizer with its default gradient_overlap=auto
  overlap      the same with overlap forced on: allreduces start from backward hooks
  ddp          torch DDP over gloo (buckets reduced from backward hooks)
  deferred     no hooks: hvdlite.torch grouped_allreduce_ of all gradients after backward (no overlap)
Phases: forward, backward (with whatever communication runs during it), sync (waiting for gradients after
backward), update (optimizer step). CPU seconds per step are read from /proc for the training (main) thread,
hvdlite's engine thread and all other threads (gloo, MPI), on rank 0. One JSON line per method.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402


def thread_cpu_seconds() -> dict[int, float]:
    """user+system CPU seconds of every thread of this process, by native thread id (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("resnet50", "transformer"), default="transformer")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8, help="timed steps per method (after one warm-up step)")
    p.add_argument("--hvd-setting", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import torch
    from torch.nn import functional as F
    import hvdlite.torch as hvd
    from shapes import ResNet, small_transformer
    hvd.init(**_common.parse_settings(args.hvd_setting))
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    threads = max(1, (os.cpu_count() or 1) // comm.Get_size())
    torch.set_num_threads(threads)
    _common.init_gloo(comm)
    if args.model == "resnet50":
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            return ResNet(num_classes=10)
        x = torch.randn(args.batch, 3, 64, 64)
    else:
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            return small_transformer(10)
        x = torch.randint(0, 16000, (args.batch, 64))
    y = torch.randint(0, 10, (args.batch,))

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    m_single, m_hvd, m_ovl, m_def = build(), build(), build(), build()
    m_ddp = torch.nn.parallel.DistributedDataParallel(build(), **_ddp_no_buffer_sync())
    o_single, o_ddp, o_def = sgd(m_single), sgd(m_ddp), sgd(m_def)
    o_hvd = hvd.DistributedOptimizer(sgd(m_hvd), named_parameters=m_hvd.named_parameters())
    o_ovl = hvd.DistributedOptimizer(sgd(m_ovl), named_parameters=[("ovl." + n, p) for n, p in
                                                                  m_ovl.named_parameters()])
    o_ovl.overlap = True
    params_def = list(m_def.parameters())
    pc = time.perf_counter

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, kind: str) -> tuple[float, ...]:
        t0 = pc()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t1 = pc()
        loss.backward()
        t2 = pc()
        if kind in ("hvdlite", "overlap"):
            opt.synchronize()  # type: ignore[attr-defined]
            t3 = pc()
            with opt.skip_synchronize():  # type: ignore[attr-defined]
                opt.step()
        elif kind == "deferred":
            hvd.grouped_allreduce_([q.grad for q in params_def], name="deferred", op=hvd.Average)
            t3 = pc()
            opt.step()
        else:
            t3 = pc()
            opt.step()
        t4 = pc()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

    methods: dict[str, Callable[[], tuple[float, ...]]] = {
        "single": lambda: step(m_single, o_single, "single"), "hvdlite": lambda: step(m_hvd, o_hvd, "hvdlite"),
        "overlap": lambda: step(m_ovl, o_ovl, "overlap"),
        "ddp": lambda: step(m_ddp, o_ddp, "ddp"), "deferred": lambda: step(m_def, o_def, "deferred")}
    main_tid = threading.main_thread().native_id
    engine_tid = next(t.native_id for t in threading.enumerate() if t.name == "hvdlite-engine")
    phases: dict[str, list[tuple[float, ...]]] = {k: [] for k in methods}
    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in methods}
    for rnd in range(args.rounds + 1):
        for name, fn in methods.items():
            if name == "single" and rank != 0:
                request = comm.Ibarrier()
                while not request.Test():
                    time.sleep(0.002)
                continue
            if name != "single":
                comm.Barrier()
            before = thread_cpu_seconds()
            result = fn()
            after = thread_cpu_seconds()
            if name == "single":
                comm.Ibarrier().Wait()
            if rnd == 0:
                continue
            phases[name].append(result)
            split = {"main": 0.0, "engine": 0.0, "other": 0.0}
            for tid, seconds in after.items():
                key = "main" if tid == main_tid else "engine" if tid == engine_tid else "other"
                split[key] += seconds - before.get(tid, 0.0)
            cpu[name].append(split)
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("profile_step", comm.Get_size(), model=args.model, batch=args.batch,
                                     rounds=args.rounds, threads_per_rank=threads))
    for name in methods:
        if rank != 0:
            break
        med = [statistics.median(r[i] for r in phases[name]) * 1e3 for i in range(5)]
        mean_cpu = {k: statistics.mean(c[k] for c in cpu[name]) * 1e3 for k in ("main", "engine", "other")}
        output.emit({"bench": "profile_step", "model": args.model, "method": name, "forward_ms": med[0],
                     "backward_ms": med[1], "sync_ms": med[2], "update_ms": med[3], "step_ms": med[4],
                     "cpu_ms_main": mean_cpu["main"], "cpu_ms_engine": mean_cpu["engine"],
                     "cpu_ms_other_threads": mean_cpu["other"]})
    output.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    hvd.shutdown()


def _ddp_no_buffer_sync() -> dict[str, bool]:
    from train_throughput import ddp_no_buffer_sync
    return ddp_no_buffer_sync()


if __name__ == "__main__":
    main()
