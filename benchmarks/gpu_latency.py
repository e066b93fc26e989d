"""GPU per-op latency: tiny CUDA allreduces through hvdlite.torch against torch.distributed's NCCL directly, in
one process, rounds alternating (goals: one op <= 2x NCCL direct, 1,000 in flight <= 1.3x).

    mpiexec -n 1 python benchmarks/gpu_latency.py [--out benchmarks/results/gpu_latency.json]
    mpiexec -n N python benchmarks/gpu_latency.py          (N GPUs on the host: one per rank, local rank's)

Without a CUDA device it prints one JSON line ``{"bench": "gpu_latency", "kind": "skipped", "reason": "no CUDA
device"}`` and exits 0 (a smoke test runs it). ``--dry-run-cpu`` runs every measure on CPU tensors instead (gloo
for the plane and the direct group, ``hvdlite.torch.tensors.STAGE_HOST_COPIES`` for staging): it checks the
script, its figures mean nothing for a GPU.

Methods (one JSON line each, after a machine line; times are the slowest rank's per round, medians over rounds):
  latency_hvdlite          blocking ``hvd.allreduce_(t, name=...)`` of a --elems float32 CUDA tensor (Average,
                           the NCCL data plane), per call, the result ready on the GPU when it returns.
  latency_direct           ``ProcessGroupNCCL.allreduce([t])`` on a group of our own, then ``wait()`` and the
                           current stream's ``synchronize()`` (the host sees the result, as after hvdlite's call).
  latency_staged           hvdlite with gpu_operations=mpi and CUDA-aware MPI off: host staging through MPI.
  inflight_hvdlite         --inflight named ``allreduce_async_`` (warm names), then ``synchronize`` each handle.
  inflight_direct          --inflight ``allreduce`` works started (async), then each waited for, one stream sync.
  inflight_staged          the hvdlite in-flight burst under host staging.
  inflight_cold_hvdlite    --inflight unnamed ``allreduce_async`` (fresh names per burst, negotiated from scratch).
A ``kind: summary`` line gives hvdlite / direct for both (goals 2.0 and 1.3) and staged / direct.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elems", type=int, default=4, help="float32 elements per allreduce")
    p.add_argument("--iters", type=int, default=200, help="blocking calls per latency round")
    p.add_argument("--inflight", type=int, default=1000, help="allreduces in flight together")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per measure (median reported)")
    p.add_argument("--dry-run-cpu", action="store_true", help="CPU tensors and gloo: checks the script only")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


def direct_group(comm: Any, backend: str) -> Any:
    """A torch.distributed process group of our own (not the default group, not hvdlite's planes) on a TCPStore
    that rank 0 serves and announces over MPI."""
    import torch.distributed as dist
    hosts = comm.allgather(socket.gethostname())
    host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        store = dist.TCPStore(host, 0, size, True, wait_for_workers=False)
        comm.bcast((host, store.port))
    else:
        host, port = comm.bcast(None)
        store = dist.TCPStore(host, port, size, False)
    prefixed = dist.PrefixStore("gpu_latency/", store)
    group = dist.ProcessGroupNCCL(prefixed, rank, size) if backend == "nccl" else \
        dist.ProcessGroupGloo(prefixed, rank, size)
    return group, store


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import mpi4py
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI
    import torch
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    output = _common.Output(rank, args.out)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run_cpu:
        output.emit({"bench": "gpu_latency", "kind": "skipped", "reason": "no CUDA device", "ranks": size})
        output.close()
        return
    import hvdlite.torch as hvd
    if cuda:
        local = int(comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank())
        if local >= torch.cuda.device_count():
            raise SystemExit(f"rank {rank}: local rank {local} but {torch.cuda.device_count()} GPUs on this host; "
                             f"run at most one rank per GPU")
        torch.cuda.set_device(local)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plane = {"gpu_operations": "nccl"} if cuda else {"cpu_operations": "gloo"}
    staged = {"gpu_operations": "mpi", "mpi_cuda_aware": "off"} if cuda else {}
    output.emit(_common.machine_info("gpu_latency", size, elems=args.elems, iters=args.iters,
                                     inflight=args.inflight, rounds=args.rounds, dry_run_cpu=not cuda,
                                     gpu=torch.cuda.get_device_name() if cuda else None,
                                     cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version()) if cuda else None))
    group, _store = direct_group(comm, "nccl" if cuda else "gloo")
    import torch.distributed as dist

    def sync() -> None:
        if cuda:
            torch.cuda.current_stream().synchronize()

    one = torch.ones(args.elems, device=device)
    many = [torch.full((args.elems,), float(i), device=device) for i in range(args.inflight)]

    def latency_direct() -> None:
        for _ in range(args.iters):
            group.allreduce([one], dist.AllreduceOptions()).wait()
            sync()

    def inflight_direct() -> None:
        works = [group.allreduce([t], dist.AllreduceOptions()) for t in many]
        for w in works:
            w.wait()
        sync()

    def latency_hvd() -> None:
        for _ in range(args.iters):
            hvd.allreduce_(one, name="gpu.latency")

    def inflight_hvd() -> None:
        handles = [hvd.allreduce_async_(t, name=f"gpu.inflight.{i}") for i, t in enumerate(many)]
        for h in handles:
            hvd.synchronize(h)

    def inflight_cold() -> None:
        handles = [hvd.allreduce_async(t) for t in many]
        for h in handles:
            hvd.synchronize(h)

    times: dict[str, list[float]] = {}

    def measure(loops: dict[str, Callable[[], None]]) -> None:
        """One warm-up each, then --rounds rounds alternating the loops (a barrier before each)."""
        for fn in loops.values():
            _common.timed(comm, fn)
        for _ in range(args.rounds):
            for key, fn in loops.items():
                times.setdefault(key, []).append(_common.timed(comm, fn))

    # hvdlite on the device data plane, alternating with NCCL direct round by round
    hvd.init(**plane)
    measure({"latency_hvdlite": latency_hvd, "latency_direct": latency_direct,
             "inflight_hvdlite": inflight_hvd, "inflight_direct": inflight_direct})
    measure({"inflight_cold_hvdlite": inflight_cold, "inflight_direct": inflight_direct})
    hvd.shutdown()
    # host staging through hvdlite's MPI path, alternating with NCCL direct again
    from hvdlite.torch import tensors  # (without CUDA: CPU tensors through the host-staging path)
    tensors.STAGE_HOST_COPIES = not cuda
    hvd.init(**staged)
    measure({"latency_staged": latency_hvd, "latency_direct": latency_direct,
             "inflight_staged": inflight_hvd, "inflight_direct": inflight_direct})
    hvd.shutdown()

    base = {"bench": "gpu_latency", "ranks": size, "elems": args.elems, "dry_run_cpu": not cuda}
    result: dict[str, float] = {}
    for key, series in times.items():
        worst = [max(comm.allgather(t)) for t in series]  # the slowest rank per round
        per = args.iters if key.startswith("latency") else 1
        scale, unit = (1e6 / per, "us") if key.startswith("latency") else (1e3, "ms")
        med = statistics.median(worst) * scale
        result[key] = med
        output.emit({**base, "method": key, unit: med, f"{unit}_min": min(worst) * scale,
                     f"{unit}_max": max(worst) * scale, "rounds": len(worst),
                     **({"count": args.inflight} if unit == "ms" else {"iters": args.iters})})
    output.emit({**base, "kind": "summary",
                 "latency_hvdlite_over_direct": result["latency_hvdlite"] / result["latency_direct"],
                 "latency_staged_over_direct": result["latency_staged"] / result["latency_direct"],
                 "inflight_hvdlite_over_direct": result["inflight_hvdlite"] / result["inflight_direct"],
                 "inflight_cold_hvdlite_over_direct": result["inflight_cold_hvdlite"] / result["inflight_direct"],
                 "inflight_staged_over_direct": result["inflight_staged"] / result["inflight_direct"],
                 "goals": {"latency_hvdlite_over_direct": 2.0, "inflight_hvdlite_over_direct": 1.3},
                 "overhead": "benchmarks/lab/gpu_overhead.py (single-GPU training step, goal <= 1%)"})
    output.emit({"bench": "gpu_latency", "kind": "done"})
    output.close()
    shutdown = getattr(group, "shutdown", None)
    if cuda and shutdown is not None:
        shutdown()  # NCCL's communicators go before the process exits


if __name__ == "__main__":
    main()
