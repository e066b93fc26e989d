"""What ranks waiting in an allreduce cost a rank that is still computing (a straggler, a tf.function tracing).

Run:   mpiexec -n 2 python benchmarks/lab/peer_wait.py [--hvd-module horovod.torch] [--out FILE]
Smoke: mpiexec -n 2 python benchmarks/lab/peer_wait.py --work 20000 --rounds 1

Rank 0 runs --work iterations of pure Python (about 1 s by default) while the other ranks wait for it, then
joins them. Each round measures three ways of waiting, in turn: ``sleep`` (the baseline: the others wait
outside any library, polling an MPI barrier every 10 ms), ``hvdlite`` (they wait in ``hvdlite.torch``'s
``allreduce``, under a fresh name each round: negotiated in full, as in a first step or while a tf.function
traces) and, with --hvd-module, ``module`` (in that module's ``allreduce``; it runs in a session of its own
after hvdlite's is shut down, with its own baseline rounds, so only one engine is up at a time).
One JSON line per way: rank 0's compute seconds (median over rounds), ``slowdown`` (that over the same
session's ``sleep`` median: 1.0 means waiting costs the computing rank nothing) and the waiting ranks' CPU, in
percent of a core over the wait (the median round, the busiest waiting rank). On a node with as many cores
as ranks the computing rank should keep its core; with more ranks than cores it needs the waiting ranks'.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpi4py import MPI  # noqa: E402

import _common  # noqa: E402


def compute(iterations: int) -> int:
    """Pure Python work that holds the GIL: what a rank still tracing or preparing a batch does."""
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def sleep_wait(comm: Any) -> None:
    """The baseline: wait for rank 0 outside any library, polling a barrier every 10 ms."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def one_round(comm: Any, work: int, wait: Callable[[], None]) -> dict[str, float]:
    """Rank 0 computes while the others ``wait()``; every rank reports its wall and CPU seconds."""
    comm.Barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if comm.Get_rank() == 0:
        compute(work)
        seconds = time.perf_counter() - wall0
        wait()
    else:
        wait()
        seconds = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    return {"seconds": seconds, "cpu_percent": 100.0 * cpu / max(seconds, 1e-9)}


Rounds = dict[str, list[dict[str, float]]]


def session(comm: Any, work: int, rounds: int, ways: dict[str, Callable[[], None]]) -> Rounds:
    """``rounds`` rounds of every way in turn (interleaved, so load from elsewhere hits them alike)."""
    seen: Rounds = {name: [] for name in ways}
    for _ in range(rounds):
        for name, wait in ways.items():
            seen[name].append(one_round(comm, work, wait))
    return seen


def report(comm: Any, output: _common.Output, base: dict[str, Any], seen: Rounds,
           module: str) -> None:
    everyone = comm.gather(seen, root=0)
    if comm.Get_rank() != 0:
        return
    compute_s = {name: statistics.median(r["seconds"] for r in rounds) for name, rounds in everyone[0].items()}
    for name, rounds in everyone[0].items():
        waiting = [statistics.median(r["cpu_percent"] for r in other[name]) for other in everyone[1:]]
        output.emit({**base, "method": name, "session": module or "hvdlite",
                     "compute_seconds": compute_s[name], "slowdown": compute_s[name] / compute_s["sleep"],
                     "compute_seconds_all": [r["seconds"] for r in rounds],
                     "waiting_cpu_percent": max(waiting) if waiting else 0.0})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=int, default=15_000_000, help="rank 0's Python loop iterations per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hvd-module", default="", help="a Horovod-compatible torch module to measure too")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import torch

    import hvdlite.torch as hvd
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    output = _common.Output(comm.Get_rank(), args.out)
    base = {"bench": "peer_wait", "ranks": comm.Get_size(), "work": args.work}
    output.emit(_common.machine_info("peer_wait", comm.Get_size(), work=args.work, rounds=args.rounds,
                                     module=args.hvd_module or None))
    one = torch.ones(4)

    def waits_in(module: Any) -> Callable[[], None]:
        """A fresh name each round, as in a first step or while a tf.function traces: negotiated in full."""
        count = itertools.count()
        return lambda: module.allreduce(one, name=f"peer_wait.{next(count)}")

    hvd.init()
    report(comm, output, base, session(comm, args.work, args.rounds,
                                       {"sleep": lambda: sleep_wait(comm), "hvdlite": waits_in(hvd)}), "")
    comm.Barrier()
    hvd.shutdown()
    if args.hvd_module:
        module = _common.load_hvd_module(args.hvd_module)
        report(comm, output, base, session(comm, args.work, args.rounds,
                                           {"sleep": lambda: sleep_wait(comm), "module": waits_in(module)}),
               args.hvd_module)
        comm.Barrier()
        module.shutdown()
    output.emit({"bench": "peer_wait", "kind": "done"})
    output.close()


if __name__ == "__main__":
    main()
