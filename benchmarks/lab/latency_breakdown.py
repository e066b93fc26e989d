"""Where one small synchronous allreduce's time goes: timestamps inside the engine, per op, median of many.

Run:   mpiexec -n 2 python benchmarks/lab/latency_breakdown.py [--out benchmarks/results/latency_breakdown.json]
Smoke: mpiexec -n 2 python benchmarks/lab/latency_breakdown.py --ops 20

Wraps engine methods with timers (no library change): for each ``allreduce_async`` + ``synchronize`` of
--elems float32 it records, from the call, when submit() returned, the engine's cycle began, the
negotiation bit-vector all-reduce began and ended, the data work began, the handle completed, and the caller
woke with the result. One JSON line per phase (median and 10th/90th percentiles over --ops, rank 0's view).
"""
from __future__ import annotations

import argparse
import bisect
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402
from hvdlite.core.engine import completion, handles, loop  # noqa: E402

PHASES = ("submitted", "cycle_start", "negotiation_start", "negotiation_end", "data_start", "completed", "woken")
_stamps: dict[str, list[float]] = {k: [] for k in PHASES[1:-1]}


def _timed(cls: Any, method: str, before: str = "", after: str = "", when: Callable[..., bool] = lambda *a: True
           ) -> None:
    original = getattr(cls, method)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        hit = when(*args)
        if before and hit:
            _stamps[before].append(time.perf_counter())
        result = original(self, *args, **kwargs)
        if after and hit:
            _stamps[after].append(time.perf_counter())
        return result
    setattr(cls, method, wrapper)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--elems", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    _timed(loop.Engine, "_cycle", before="cycle_start")
    _timed(loop.Engine, "_allreduce_or", before="negotiation_start", after="negotiation_end")
    _timed(completion.Completion, "_run_work", before="data_start", when=lambda work: bool(work))
    _timed(handles.Handle, "settle", before="completed")
    hvd.init()
    output = _common.Output(hvd.rank(), args.out)
    output.emit(_common.machine_info("latency_breakdown", hvd.size(), ops=args.ops, elems=args.elems))
    a = np.ones(args.elems, np.float32)
    for _ in range(50):
        hvd.allreduce(a, name="latency", op=hvd.Sum)
    for stamps in _stamps.values():
        stamps.clear()
    calls = []
    for _ in range(args.ops):
        t0 = time.perf_counter()
        handle = hvd.allreduce_async(a, name="latency", op=hvd.Sum)
        t1 = time.perf_counter()
        hvd.synchronize(handle)
        calls.append((t0, t1, time.perf_counter()))
    rows: dict[str, list[float]] = {k: [] for k in PHASES}
    for t0, t1, t2 in calls:
        rows["submitted"].append(t1 - t0)
        rows["woken"].append(t2 - t0)
        for phase, stamps in _stamps.items():
            i = bisect.bisect_left(stamps, t0)  # the first of this phase after the call began
            rows[phase].append(stamps[i] - t0 if i < len(stamps) and stamps[i] <= t2 else float("nan"))
    cycles = hvd.engine_stats()["cycles"]
    if hvd.rank() == 0:
        for phase in PHASES:
            us = np.array(rows[phase]) * 1e6
            output.emit({"bench": "latency_breakdown", "phase": phase, "us_since_call": float(np.nanmedian(us)),
                         "p10": float(np.nanpercentile(us, 10)), "p90": float(np.nanpercentile(us, 90))})
    output.emit({"bench": "latency_breakdown", "kind": "done", "engine_cycles": cycles})
    output.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
