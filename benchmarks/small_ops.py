"""Small collectives: one tiny allreduce's latency, 1,000 small allreduces in flight, and idle engine CPU.

Run:   mpiexec -n 2 python benchmarks/small_ops.py [--out benchmarks/results/small_ops.json]
Smoke: mpiexec -n 2 python benchmarks/small_ops.py --iters 20 --reps 2 --inflight 50 --idle-seconds 0.5

Methods (one JSON line each, after a machine line):
  latency_mpi4py           raw mpi4py ``Allreduce`` of --elems float32 (buffer interface), per call.
  latency_mpi4py_pickle    mpi4py's pickle-based ``allreduce`` of the same array, per call.
  latency_hvdlite          ``hvd.allreduce`` of the same array (named, so the response cache is used).
  inflight_fused           --inflight named ``allreduce_async`` submitted together, then synchronize all,
                           with the default fusion threshold.
  inflight_unfused         the same with ``fusion_threshold=0`` (hvdlite re-initialised).
  inflight_mpi_loop        reference: the same number of raw ``Allreduce`` calls, one after another.
  inflight_mpi_one         reference: one raw ``Allreduce`` of all the elements together.
  idle_cpu_baseline        percent of a core the process burns while sleeping, MPI up, hvdlite not.
  idle_cpu_hvdlite         the same with hvdlite's engine running and idle (right after init and after
                           work), the worst rank; the engine must not spin.
Latencies and in-flight rounds are medians over --reps rounds (the slowest rank's time per round);
ratios compare against the raw mpi4py reference. fused and unfused sessions alternate --sessions times.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elems", type=int, default=4, help="float32 elements per small allreduce")
    p.add_argument("--iters", type=int, default=300, help="latency: calls per round")
    p.add_argument("--reps", type=int, default=11, help="rounds per measurement (median reported)")
    p.add_argument("--inflight", type=int, default=1000, help="allreduces in flight together")
    p.add_argument("--sessions", type=int, default=2, help="alternating fused/unfused hvdlite sessions")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="seconds per idle CPU measurement")
    p.add_argument("--hvd-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="hvdlite init() setting, e.g. cycle_time=0.5 (repeatable)")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


def per_round(comm: Any, fn: Callable[[], None], reps: int, warmup: int = 1) -> list[float]:
    """Seconds per round on this rank, each round after a barrier."""
    for _ in range(warmup):
        _common.timed(comm, fn)
    return [_common.timed(comm, fn) for _ in range(reps)]


def slowest_median(comm: Any, times: list[float], divide: int = 1) -> dict[str, float]:
    s = _common.summarize(comm, _common.Series("x", times))
    return {"us": s["ms"] * 1e3 / divide, "us_min": s["ms_min"] * 1e3 / divide,
            "us_max": s["ms_max"] * 1e3 / divide, "reps": s["reps"]}


def idle_cpu(comm: Any, seconds: float) -> dict[str, float]:
    """Every rank sleeps at the same time; the worst rank's CPU percent, and engine cycles if any."""
    comm.Barrier()
    cycles0 = hvd.engine_stats()["cycles"] if hvd.is_initialized() else 0
    pct = _common.idle_cpu_percent(seconds)
    cycles = (hvd.engine_stats()["cycles"] - cycles0) if hvd.is_initialized() else 0
    worst = comm.allreduce(pct, op=__import__("mpi4py").MPI.MAX)
    return {"cpu_percent": worst, "seconds": seconds, "engine_cycles_per_s": cycles / seconds}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = _common.parse_settings(args.hvd_setting)
    import mpi4py
    mpi4py.rc.thread_level = "multiple"  # what hvdlite asks for; the raw baselines run under the same
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("small_ops", size, elems=args.elems, iters=args.iters, reps=args.reps,
                                     inflight=args.inflight, sessions=args.sessions,
                                     settings=settings))
    base = {"bench": "small_ops", "ranks": size, "elems": args.elems}

    output.emit({**base, "method": "idle_cpu_baseline", **idle_cpu(comm, args.idle_seconds)})

    send = np.ones(args.elems, dtype=np.float32)
    recv = np.empty_like(send)
    many = [np.full(args.elems, float(i), dtype=np.float32) for i in range(args.inflight)]
    many_recv = [np.empty_like(a) for a in many]
    together = np.ones(args.elems * args.inflight, dtype=np.float32)
    together_recv = np.empty_like(together)

    def mpi_loop() -> None:
        for _ in range(args.iters):
            comm.Allreduce(send, recv, op=MPI.SUM)

    def pickle_loop() -> None:
        for _ in range(args.iters):
            comm.allreduce(send, op=MPI.SUM)

    def hvd_loop() -> None:
        for _ in range(args.iters):
            hvd.allreduce(send, name="small.latency", op=hvd.Sum)

    def inflight_hvd() -> None:
        handles = [hvd.allreduce_async(a, name=f"small.inflight.{i}", op=hvd.Sum) for i, a in enumerate(many)]
        for h in handles:
            hvd.synchronize(h)

    def inflight_mpi_loop() -> None:
        for a, r in zip(many, many_recv):
            comm.Allreduce(a, r, op=MPI.SUM)

    times: dict[str, list[float]] = {k: [] for k in ("latency_mpi4py", "latency_mpi4py_pickle",
                                                     "latency_hvdlite", "inflight_fused", "inflight_unfused",
                                                     "inflight_mpi_loop", "inflight_mpi_one")}
    stats: dict[str, list[int]] = {"inflight_fused": [0, 0, 0], "inflight_unfused": [0, 0, 0]}
    idle_records: list[dict[str, Any]] = []
    for session in range(args.sessions):
        for fused in (True, False):
            hvd.init(**({**settings, "fusion_threshold": 0} if not fused else settings))
            if session == 0 and fused:
                idle_records.append({"when": "after_init", **idle_cpu(comm, args.idle_seconds)})
                loops = {"latency_mpi4py": mpi_loop, "latency_mpi4py_pickle": pickle_loop,
                         "latency_hvdlite": hvd_loop}
                for fn in loops.values():
                    _common.timed(comm, fn)  # warm-up
                for _ in range(args.reps):  # interleave the three loops round by round
                    for key, fn in loops.items():
                        times[key].append(_common.timed(comm, fn))
            key = "inflight_fused" if fused else "inflight_unfused"
            before = hvd.engine_stats()
            times[key] += per_round(comm, inflight_hvd, args.reps)
            after = hvd.engine_stats()
            stats[key][0] += after["cycles"] - before["cycles"]
            stats[key][1] += after["mpi_calls"] - before["mpi_calls"]
            stats[key][2] += args.reps + 1
            if session == 0 and fused:
                idle_records.append({"when": "after_work", **idle_cpu(comm, args.idle_seconds)})
            hvd.shutdown()
        times["inflight_mpi_loop"] += per_round(comm, inflight_mpi_loop, args.reps)
        times["inflight_mpi_one"] += per_round(
            comm, lambda: comm.Allreduce(together, together_recv, op=MPI.SUM), args.reps)

    lat = {k: slowest_median(comm, times[k], args.iters) for k in ("latency_mpi4py", "latency_mpi4py_pickle",
                                                                     "latency_hvdlite")}
    for key, res in lat.items():
        output.emit({**base, "method": key, **res, "ratio_to_mpi4py": res["us"] / lat["latency_mpi4py"]["us"]})
    inflight = {k: slowest_median(comm, times[k]) for k in ("inflight_fused", "inflight_unfused",
                                                            "inflight_mpi_loop", "inflight_mpi_one")}
    for key, res in inflight.items():
        record = {**base, "method": key, "count": args.inflight, "ms": res["us"] / 1e3,
                  "ms_min": res["us_min"] / 1e3, "ms_max": res["us_max"] / 1e3, "reps": res["reps"],
                  "ops_per_s": args.inflight / (res["us"] / 1e6),
                  "speedup_vs_unfused": inflight["inflight_unfused"]["us"] / res["us"]}
        if key in stats and stats[key][2]:
            record["engine_cycles_per_round"] = stats[key][0] / stats[key][2]
            record["mpi_calls_per_round"] = stats[key][1] / stats[key][2]
        output.emit(record)
    for rec in idle_records:
        output.emit({**base, "method": "idle_cpu_hvdlite", **rec})
    output.emit({"bench": "small_ops", "kind": "done"})
    output.close()


if __name__ == "__main__":
    main()
