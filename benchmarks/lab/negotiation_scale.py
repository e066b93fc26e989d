"""Negotiation cost against job size: bytes and MPI calls per step per rank (first step, cached step, unnamed op).

Run:  python benchmarks/lab/negotiation_scale.py [--sizes 2,4,...,128] [--tensors 16] [--steps 40] [--launcher CMD]
It launches ``mpiexec -n N`` for each size (oversubscribed: ``-bind-to none``; numpy core only) and prints one JSON
object: per size, what each rank's engine counted per round (the bytes it sent in the bit-vector all-reduce and
received in votes and explaining allgathers; the negotiation's MPI calls) for a first step of ``--tensors`` new
names, a cached step of the same names, one unnamed allreduce of a loop and a cached step of the others while rank 0
has joined; and what the kernel counted (``/proc/self/io``'s rchar + wchar: socket bytes under a TCP transport,
e.g. ``--launcher "/work/venvs/ompi5/bin/mpiexec --oversubscribe --mca btl tcp,self --mca pml ob1"``; ~0 over
shared memory), beside a raw MPI all-reduce of one float measured the same way, and its time and that of a raw
all-reduce of the bit vector's words (to separate what oversubscription costs every collective from what the
negotiation adds).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
COUNTED = ("cycles", "full_cycles", "explain_cycles", "bitvector_bytes", "vote_bytes", "full_path_bytes",
           "negotiation_calls")


def io_bytes() -> int:
    """This process's bytes through read/write system calls so far (sockets included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def worker(tensors: int, steps: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import hvdlite as hvd
    from hvdlite.core import runtime

    hvd.init()
    engine = runtime.state().engine

    def run(names: list[str]) -> None:
        handles = [hvd.allreduce_async(np.ones(4, np.float32), op=hvd.Sum, name=name) for name in names]
        for h in handles:
            hvd.synchronize(h)

    def measure(step: Callable[[int], Any], rounds: int) -> dict[str, Any]:
        """Per step (``rounds`` of them), what the engine counted, the kernel's bytes, the time and CPU time."""
        hvd.barrier()
        before, io0, cpu0, times = dict(engine.stats()), io_bytes(), time.process_time(), []
        for s in range(rounds):
            start = time.perf_counter()
            step(s)
            times.append(time.perf_counter() - start)
        io1, cpu1, after = io_bytes(), time.process_time(), engine.stats()
        d = {k: (after[k] - before[k]) / rounds for k in COUNTED}
        d["engine_bytes"] = d["bitvector_bytes"] + d["vote_bytes"] + d["full_path_bytes"]
        d["kernel_bytes"] = (io1 - io0) / rounds
        d["ms"], d["median_ms"] = 1000 * sum(times) / rounds, 1000 * statistics.median(times)
        d["cpu_ms"] = 1000 * (cpu1 - cpu0) / rounds  # this process's CPU (all its threads): what ranks share
        return d

    steady = [f"steady.{i}" for i in range(tensors)]
    run(steady)  # agreed once; then they hit the cache
    cached = measure(lambda s: run(steady), steps)
    first = measure(lambda s: run([f"new.{s}.{i}" for i in range(tensors)]), max(1, steps // 4))
    hvd.allreduce(np.ones(1), op=hvd.Sum)  # the unnamed stream's first op: a vote
    unnamed = measure(lambda s: hvd.allreduce(np.ones(1), op=hvd.Sum), steps)
    joined: dict[str, Any] = {}  # rank 0 has joined: the others' cached steps (its stand-ins), measured on them
    if hvd.rank() == 0:
        hvd.join()
    else:
        run(steady)  # (it completes once rank 0's join is agreed)
        joined = measure(lambda s: run(steady), steps)
        hvd.join()
    comm = MPI.COMM_WORLD

    def raw(data: Any, op: Any) -> tuple[float, float]:
        """A raw MPI all-reduce of ``data``: its kernel bytes and median microseconds per call on this rank."""
        out, times = np.empty_like(data), []
        comm.Barrier()
        io0 = io_bytes()
        for _ in range(steps):
            start = time.perf_counter()
            comm.Allreduce(data, out, op=op)
            times.append(time.perf_counter() - start)
        return (io_bytes() - io0) / steps, 1e6 * statistics.median(times)

    raw_bytes, raw_us = raw(np.ones(1), MPI.SUM)
    vector_us = raw(np.zeros(engine.cache.vector_words, np.uint64), MPI.BOR)[1]  # the bit vector's size
    rows = hvd.allgather_object({"first": first, "cached": cached, "unnamed": unnamed, "joined": joined,
                                 "raw_us": raw_us, "raw_mpi_kernel_bytes": raw_bytes, "vector_us": vector_us})
    if hvd.rank() == 0:
        mean = {path: {k: sum(r[path][k] for r in rows if r[path]) / len([r for r in rows if r[path]])
                       for k in rows[-1][path]} for path in ("first", "cached", "unnamed", "joined")}
        print("RESULT " + json.dumps({
            "ranks": hvd.size(), "tensors_per_step": tensors, "per_rank_mean": mean,
            "per_rank_max_engine_bytes": {p: max(r[p]["engine_bytes"] for r in rows if r[p]) for p in mean},
            "raw_mpi_allreduce_kernel_bytes": sum(r["raw_mpi_kernel_bytes"] for r in rows) / len(rows),
            # each rank's median microseconds per call, mean over the ranks: one float (SUM), the bit vector (BOR)
            "raw_mpi_allreduce_us": sum(r["raw_us"] for r in rows) / len(rows),
            "raw_mpi_vector_allreduce_us": sum(r["vector_us"] for r in rows) / len(rows),
        }), flush=True)
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16,32,64,128")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--launcher", default="mpiexec -bind-to none", help="mpiexec and its flags")
    parser.add_argument("--python", default=sys.executable, help="the ranks' interpreter")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tensors, args.steps)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HVDLITE_CYCLE_TIME=os.environ.get("HVDLITE_CYCLE_TIME", "5"))
    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        cmd = [*shlex.split(args.launcher), "-n", str(n), args.python, __file__, "--worker",
               "--tensors", str(args.tensors), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        results.append(json.loads(lines[0][7:]))
        print(f"# {n} ranks done: {json.dumps(results[-1])}", file=sys.stderr, flush=True)  # kept if a later size fails
    print(json.dumps({"benchmark": "negotiation_scale", "cpus": os.cpu_count(), "launcher": args.launcher,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
