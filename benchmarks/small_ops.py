"""Small collectives: one tiny allreduce's latency, 1,000 small allreduces in flight, and idle engine CPU.

Run:   mpiexec -n 2 python benchmarks/small_ops.py [--hvd-module horovod.torch]
           [--out benchmarks/results/small_ops.json]
Smoke: mpiexec -n 2 python benchmarks/small_ops.py --iters 20 --reps 2 --inflight 50 --idle-seconds 0.5

Methods (one JSON line each, after a machine line):
  latency_mpi4py           raw mpi4py ``Allreduce`` of --elems float32 (buffer interface), per call; measured
                           in every session (hvdlite's and the module's), so it is the common reference.
  latency_mpi4py_pickle    mpi4py's pickle-based ``allreduce`` of the same array, per call.
  latency_hvdlite          ``hvd.allreduce`` of the same array (core numpy API, named, Sum).
  latency_hvdlite_torch    ``hvdlite.torch.allreduce_`` of a --elems float32 torch tensor, in place, named, the
                           default op (Average), what a user calls; ``ratio_to_module`` when --hvd-module is given.
  latency_module           the same call through --hvd-module NAME (e.g. horovod.torch).
  inflight_fused           --inflight named ``allreduce_async`` (numpy, Sum) submitted together, then synchronize
                           all, with the default fusion threshold.
  inflight_unfused         the same with ``fusion_threshold_bytes=0`` (hvdlite re-initialised).
  inflight_cold_hvdlite_torch  what a user waits for: --inflight unnamed ``hvdlite.torch.allreduce_async`` on
                           torch tensors (Average, out of place), then ``synchronize`` each handle, from the first
                           submission to the last completion (the slowest rank's, after a barrier). Unnamed ops
                           get fresh generated names in every burst, so each burst is negotiated from scratch
                           (full rounds), as a program's first burst is whatever its names. ``ratio_to_module``.
  inflight_cold_module     the same through --hvd-module NAME (Horovod also generates a fresh name per op).
  inflight_named_hvdlite_torch  warm names, out of place: --inflight ``allreduce_async(t, name=f"a.{i}")``
                           (Average), then ``synchronize`` each handle, the same names every round (a warm-up
                           round first): what a user writes who names ops but does not reduce in place.
  inflight_named_module    the same through --hvd-module NAME.
  inflight_hvdlite_torch   warm names: --inflight *named* in-place ``allreduce_async_`` (Average), then
                           ``synchronize`` each handle, the same names every round after a warm-up round, so every
                           op is agreed from the response cache (one bit-vector round): the steady state of a
                           training loop's named gradients, not a first or unnamed burst. ``ratio_to_module``.
  inflight_module          the same through --hvd-module NAME.
  inflight_mpi_loop        reference: the same number of raw ``Allreduce`` calls, one after another.
  inflight_mpi_one         reference: one raw ``Allreduce`` of all the elements together.
  idle_cpu_baseline        percent of a core the process burns while sleeping, MPI up, hvdlite not.
  idle_cpu_hvdlite         the same with hvdlite's engine running and idle (right after init, after numpy work,
                           after torch-frontend work), the worst rank; the engine must not spin.
  idle_cpu_module          the same for --hvd-module's background thread (after init, after work).
A final ``kind: summary`` line holds the table of benchmarks/README.md: per measure (``latency``: one blocking op;
``inflight``: unnamed out of place; ``inflight_named``: named out of place, warm; ``inflight_warm``: named in
place, warm) hvdlite.torch's, the module's and raw mpi4py's median and best (``_best_``) and the ratios
hvdlite.torch / module (median and best), hvdlite.torch / mpi4py, module / mpi4py.

Method (alternating runs): each session initialises one engine, runs its measures interleaved round by round
with the raw mpi4py latency loop, and shuts it down; sessions go hvdlite (fused), hvdlite (fusion off), module,
repeated --sessions times, so every engine sees the same machine state and only one engine thread runs at a
time. MPI is initialised by mpi4py first (``MPI_THREAD_MULTIPLE``); Horovod 0.28.1 then uses that MPI and can be
initialised and shut down repeatedly in one process (checked with horovod.torch and MPICH 5): run this script
with the Horovod venv's python and mpiexec (``python -m benchmarks --horovod-venv VENV`` does), hvdlite from the
source tree. Latencies and in-flight rounds are medians (and bests) over all rounds, each round the slowest
rank's time; a burst is one round of --inflight ops after a barrier, a warm-up round first.
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

LATENCY = ("latency_mpi4py", "latency_mpi4py_pickle", "latency_hvdlite", "latency_hvdlite_torch", "latency_module")
INFLIGHT = ("inflight_fused", "inflight_unfused", "inflight_hvdlite_torch", "inflight_module",
            "inflight_named_hvdlite_torch", "inflight_named_module",
            "inflight_cold_hvdlite_torch", "inflight_cold_module", "inflight_mpi_loop", "inflight_mpi_one")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elems", type=int, default=16, help="float32 elements per small allreduce")
    p.add_argument("--iters", type=int, default=300, help="latency: calls per round")
    p.add_argument("--reps", type=int, default=11, help="rounds per measurement and session (median reported)")
    p.add_argument("--inflight", type=int, default=1000, help="allreduces in flight together")
    p.add_argument("--sessions", type=int, default=2, help="alternating fused/unfused/module sessions")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="seconds per idle CPU measurement")
    p.add_argument("--hvd-module", default="", help="a Horovod-compatible torch module to measure too, "
                   "e.g. horovod.torch")
    p.add_argument("--hvd-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="hvdlite init() setting, e.g. cycle_time_ms=0.5 (repeatable)")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


def per_round(comm: Any, fn: Callable[[], None], reps: int, warmup: int = 1) -> list[float]:
    """Seconds per round on this rank, each round after a barrier."""
    for _ in range(warmup):
        _common.timed(comm, fn)
    return [_common.timed(comm, fn) for _ in range(reps)]


def interleaved(comm: Any, loops: dict[str, Callable[[], None]], reps: int, times: dict[str, list[float]]) -> None:
    """One warm-up of each loop, then ``reps`` rounds, each running every loop once (barrier before each)."""
    for fn in loops.values():
        _common.timed(comm, fn)
    for _ in range(reps):
        for key, fn in loops.items():
            times[key].append(_common.timed(comm, fn))


def slowest_median(comm: Any, times: list[float], divide: int = 1) -> dict[str, float]:
    s = _common.summarize(comm, _common.Series("x", times))
    return {"us": s["ms"] * 1e3 / divide, "us_min": s["ms_min"] * 1e3 / divide,
            "us_max": s["ms_max"] * 1e3 / divide, "reps": s["reps"]}


def idle_cpu(comm: Any, seconds: float, engine: bool = True) -> dict[str, float]:
    """Every rank sleeps at the same time; the worst rank's CPU percent, and hvdlite engine cycles (``engine``)."""
    comm.Barrier()
    cycles0 = hvd.engine_stats()["cycles"] if hvd.is_initialized() else 0
    pct = _common.idle_cpu_percent(seconds)
    cycles = (hvd.engine_stats()["cycles"] - cycles0) if hvd.is_initialized() else 0
    worst = comm.allreduce(pct, op=__import__("mpi4py").MPI.MAX)
    out = {"cpu_percent": worst, "seconds": seconds}
    if engine:
        out["engine_cycles_per_s"] = cycles / seconds
    return out


class Counter:
    """What one in-flight method spends per round: hvdlite engine cycles and MPI calls, CPU seconds of the
    calling thread and of the engine thread, and the garbage collector's seconds (any thread)."""

    def __init__(self) -> None:
        self.cycles = self.calls = self.rounds = 0
        self.user_cpu = self.engine_cpu = self.gc_seconds = 0.0

    def measure(self, fn: Callable[[], list[float]], rounds: int) -> list[float]:
        import gc
        import threading
        import time
        engine = next(t for t in threading.enumerate() if t.name == "hvdlite-engine")  # for its CPU clock (Linux)
        clock = time.pthread_getcpuclockid(engine.ident)
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                self.gc_seconds += time.perf_counter() - started.pop()

        before = hvd.engine_stats()
        user0, engine0 = time.thread_time(), time.clock_gettime(clock)
        gc.callbacks.append(on_gc)
        try:
            out = fn()
        finally:
            gc.callbacks.remove(on_gc)
        self.user_cpu += time.thread_time() - user0
        self.engine_cpu += time.clock_gettime(clock) - engine0
        after = hvd.engine_stats()
        self.cycles += after["cycles"] - before["cycles"]
        self.calls += after["mpi_calls"] - before["mpi_calls"]
        self.rounds += rounds
        return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = _common.parse_settings(args.hvd_setting)
    import mpi4py
    mpi4py.rc.thread_level = "multiple"  # what hvdlite asks for; the raw baselines run under the same
    from mpi4py import MPI
    import torch
    import hvdlite.torch as hvd_torch
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("small_ops", size, elems=args.elems, iters=args.iters, reps=args.reps,
                                     inflight=args.inflight, sessions=args.sessions, settings=settings,
                                     module=args.hvd_module or None))
    base = {"bench": "small_ops", "ranks": size, "elems": args.elems}

    output.emit({**base, "method": "idle_cpu_baseline", **idle_cpu(comm, args.idle_seconds)})

    send = np.ones(args.elems, dtype=np.float32)
    recv = np.empty_like(send)
    many = [np.full(args.elems, float(i), dtype=np.float32) for i in range(args.inflight)]
    many_recv = [np.empty_like(a) for a in many]
    together = np.ones(args.elems * args.inflight, dtype=np.float32)
    together_recv = np.empty_like(together)
    # In-place Average keeps the values fixed, so the torch buffers never need refilling.
    tensor = torch.ones(args.elems, dtype=torch.float32)
    tensors = [torch.full((args.elems,), float(i), dtype=torch.float32) for i in range(args.inflight)]

    def mpi_loop() -> None:
        for _ in range(args.iters):
            comm.Allreduce(send, recv, op=MPI.SUM)

    def pickle_loop() -> None:
        for _ in range(args.iters):
            comm.allreduce(send, op=MPI.SUM)

    def hvd_loop() -> None:
        for _ in range(args.iters):
            hvd.allreduce(send, name="small.latency", op=hvd.Sum)

    def torch_loop(mod: Any) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(args.iters):
                mod.allreduce_(tensor, name="small.latency.torch")
        return loop

    def inflight_torch(mod: Any) -> Callable[[], None]:
        def run() -> None:
            handles = [mod.allreduce_async_(t, name=f"small.inflight.torch.{i}") for i, t in enumerate(tensors)]
            for h in handles:
                mod.synchronize(h)
        return run

    def inflight_named(mod: Any) -> Callable[[], None]:
        def run() -> None:  # warm names, out of place
            handles = [mod.allreduce_async(t, name=f"small.named.{i}") for i, t in enumerate(tensors)]
            for h in handles:
                mod.synchronize(h)
        return run

    def inflight_cold(mod: Any) -> Callable[[], None]:
        def run() -> None:  # unnamed: a fresh generated name per op in every burst
            handles = [mod.allreduce_async(t) for t in tensors]
            for h in handles:
                mod.synchronize(h)
        return run

    def inflight_hvd() -> None:
        handles = [hvd.allreduce_async(a, name=f"small.inflight.{i}", op=hvd.Sum) for i, a in enumerate(many)]
        for h in handles:
            hvd.synchronize(h)

    def inflight_mpi_loop() -> None:
        for a, r in zip(many, many_recv):
            comm.Allreduce(a, r, op=MPI.SUM)

    times: dict[str, list[float]] = {k: [] for k in LATENCY + INFLIGHT}
    counters = {"inflight_fused": Counter(), "inflight_unfused": Counter(), "inflight_hvdlite_torch": Counter(),
                "inflight_named_hvdlite_torch": Counter(), "inflight_cold_hvdlite_torch": Counter()}
    idle_records: list[dict[str, Any]] = []
    module: Any = None
    for session in range(args.sessions):
        # hvdlite, default fusion: latency loops interleaved, then the in-flight bursts (numpy and torch).
        hvd_torch.init(**settings)
        if session == 0:
            idle_records.append({"method": "idle_cpu_hvdlite", "when": "after_init",
                                 **idle_cpu(comm, args.idle_seconds)})
        interleaved(comm, {"latency_mpi4py": mpi_loop, "latency_mpi4py_pickle": pickle_loop,
                           "latency_hvdlite": hvd_loop, "latency_hvdlite_torch": torch_loop(hvd_torch)},
                    args.reps, times)
        times["inflight_fused"] += counters["inflight_fused"].measure(
            lambda: per_round(comm, inflight_hvd, args.reps), args.reps + 1)
        if session == 0:
            idle_records.append({"method": "idle_cpu_hvdlite", "when": "after_work",
                                 **idle_cpu(comm, args.idle_seconds)})
        times["inflight_hvdlite_torch"] += counters["inflight_hvdlite_torch"].measure(
            lambda: per_round(comm, inflight_torch(hvd_torch), args.reps), args.reps + 1)
        times["inflight_named_hvdlite_torch"] += counters["inflight_named_hvdlite_torch"].measure(
            lambda: per_round(comm, inflight_named(hvd_torch), args.reps), args.reps + 1)
        if session == 0:
            idle_records.append({"method": "idle_cpu_hvdlite", "when": "after_torch_work",
                                 **idle_cpu(comm, args.idle_seconds)})
        # cold last: its fresh names fill the response cache (the warm names would be evicted)
        times["inflight_cold_hvdlite_torch"] += counters["inflight_cold_hvdlite_torch"].measure(
            lambda: per_round(comm, inflight_cold(hvd_torch), args.reps), args.reps + 1)
        comm.Barrier()  # every rank has read its engine's CPU clock: a peer's shutdown stops this engine too
        hvd_torch.shutdown()
        # hvdlite, fusion off.
        hvd.init(**{**settings, "fusion_threshold_bytes": 0})
        times["inflight_unfused"] += counters["inflight_unfused"].measure(
            lambda: per_round(comm, inflight_hvd, args.reps), args.reps + 1)
        comm.Barrier()
        hvd.shutdown()
        # The Horovod-compatible module, alone (hvdlite is shut down).
        if args.hvd_module:
            if module is None:
                module = _common.load_hvd_module(args.hvd_module)
            else:
                module.init()
            if session == 0:
                idle_records.append({"method": "idle_cpu_module", "module": args.hvd_module, "when": "after_init",
                                     **idle_cpu(comm, args.idle_seconds, engine=False)})
            interleaved(comm, {"latency_mpi4py": mpi_loop, "latency_module": torch_loop(module)}, args.reps, times)
            times["inflight_module"] += per_round(comm, inflight_torch(module), args.reps)
            times["inflight_named_module"] += per_round(comm, inflight_named(module), args.reps)
            times["inflight_cold_module"] += per_round(comm, inflight_cold(module), args.reps)
            if session == 0:
                idle_records.append({"method": "idle_cpu_module", "module": args.hvd_module, "when": "after_work",
                                     **idle_cpu(comm, args.idle_seconds, engine=False)})
            module.shutdown()
        times["inflight_mpi_loop"] += per_round(comm, inflight_mpi_loop, args.reps)
        times["inflight_mpi_one"] += per_round(
            comm, lambda: comm.Allreduce(together, together_recv, op=MPI.SUM), args.reps)

    emit_results(comm, output, base, args, times, counters)
    for rec in idle_records:
        output.emit({**base, **rec})
    output.emit({"bench": "small_ops", "kind": "done"})
    output.close()


def emit_results(comm: Any, output: _common.Output, base: dict[str, Any], args: argparse.Namespace,
                 times: dict[str, list[float]], counters: dict[str, Counter]) -> None:
    """Latency and in-flight lines with their ratios, then the summary line (hvdlite.torch vs module vs raw)."""
    lat = {k: slowest_median(comm, times[k], args.iters) for k in LATENCY if times[k]}
    inflight = {k: slowest_median(comm, times[k]) for k in INFLIGHT if times[k]}
    raw_us = lat["latency_mpi4py"]["us"]
    for key, res in lat.items():
        record = {**base, "method": key, **res, "ratio_to_mpi4py": res["us"] / raw_us}
        if key == "latency_module":
            record["module"] = args.hvd_module
        if key == "latency_hvdlite_torch" and "latency_module" in lat:
            record["ratio_to_module"] = res["us"] / lat["latency_module"]["us"]
        output.emit(record)
    for key, res in inflight.items():
        record = {**base, "method": key, "count": args.inflight, "ms": res["us"] / 1e3,
                  "ms_min": res["us_min"] / 1e3, "ms_max": res["us_max"] / 1e3, "reps": res["reps"],
                  "ops_per_s": args.inflight / (res["us"] / 1e6),
                  "speedup_vs_unfused": inflight["inflight_unfused"]["us"] / res["us"],
                  "ratio_to_mpi_loop": res["us"] / inflight["inflight_mpi_loop"]["us"]}
        if key.endswith("_module"):
            record["module"] = args.hvd_module
        peer = key.replace("hvdlite_torch", "module")
        if key.endswith("hvdlite_torch") and peer in inflight:
            record["ratio_to_module"] = res["us"] / inflight[peer]["us"]
        counter = counters.get(key)
        if counter is not None and counter.rounds:
            record["engine_cycles_per_round"] = counter.cycles / counter.rounds
            record["mpi_calls_per_round"] = counter.calls / counter.rounds
            per_op = 1e6 / (counter.rounds * args.inflight)  # seconds per round -> microseconds per op
            record["user_cpu_us_per_op"] = counter.user_cpu * per_op
            record["engine_cpu_us_per_op"] = counter.engine_cpu * per_op
            record["gc_us_per_op"] = counter.gc_seconds * per_op
        output.emit(record)
    summary: dict[str, Any] = {"bench": "small_ops", "kind": "summary", "ranks": base["ranks"],
                               "elems": args.elems, "count": args.inflight, "module": args.hvd_module or None}
    ours = {"latency": lat["latency_hvdlite_torch"], "inflight": inflight["inflight_cold_hvdlite_torch"],
            "inflight_named": inflight["inflight_named_hvdlite_torch"],
            "inflight_warm": inflight["inflight_hvdlite_torch"]}
    peers = {"latency": lat.get("latency_module"), "inflight": inflight.get("inflight_cold_module"),
             "inflight_named": inflight.get("inflight_named_module"), "inflight_warm": inflight.get("inflight_module")}
    for measure, mine in ours.items():
        unit, scale = ("us", 1.0) if measure == "latency" else ("ms", 1e3)
        raw = (lat["latency_mpi4py"] if measure == "latency" else inflight["inflight_mpi_loop"])["us"] / scale
        theirs = peers[measure]
        for stat, field in (("", "us"), ("_best", "us_min")):
            value, other = mine[field] / scale, None if theirs is None else theirs[field] / scale
            summary[f"{measure}{stat}_hvdlite_torch_{unit}"] = value
            summary[f"{measure}{stat}_module_{unit}"] = other
            summary[f"{measure}{stat}_hvdlite_torch_over_module"] = None if other is None else value / other
        summary[f"{measure}_mpi4py_{unit}"] = raw
        summary[f"{measure}_hvdlite_torch_over_mpi4py"] = summary[f"{measure}_hvdlite_torch_{unit}"] / raw
        other = summary[f"{measure}_module_{unit}"]
        summary[f"{measure}_module_over_mpi4py"] = None if other is None else other / raw
    output.emit(summary)


if __name__ == "__main__":
    main()
