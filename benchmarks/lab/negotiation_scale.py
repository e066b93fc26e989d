"""Negotiation cost against job size: bytes per cycle on the full and cached paths, and cycle time.

Run:  python benchmarks/lab/negotiation_scale.py [--sizes 2,4,8,16,32,64] [--tensors 16] [--steps 40]
It launches ``mpiexec -n N`` for each size (oversubscribed on a small machine: ``-bind-to none``) and prints one
JSON object: per size, the bytes allgathered per full negotiation round (every rank's pickled message), the
bytes of the bit-vector all-reduce per cycle (per rank), and the wall time per cycle on each path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(tensors: int, steps: int) -> None:
    import numpy as np

    import hvdlite as hvd
    from hvdlite.core import runtime

    hvd.init()
    engine = runtime.state().engine

    def run(names: list[str]) -> None:
        handles = [hvd.allreduce_async(np.ones(4, np.float32), op=hvd.Sum, name=name) for name in names]
        for h in handles:
            hvd.synchronize(h)

    def measure(step_names: list[list[str]]) -> dict:
        hvd.barrier()
        before = dict(engine.stats())
        start = time.perf_counter()
        for names in step_names:
            run(names)
        elapsed = time.perf_counter() - start
        after = engine.stats()
        d = {k: after[k] - before[k] for k in after}
        return {"seconds": elapsed, **d}

    steady = [f"steady.{i}" for i in range(tensors)]
    run(steady)  # agree on the steady names once (full path), then they hit the cache
    cached = measure([steady] * steps)
    full = measure([[f"new.{s}.{i}" for i in range(tensors)] for s in range(max(1, steps // 4))])
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({
            "ranks": hvd.size(), "tensors_per_step": tensors,
            "full_path_bytes_per_round": full["full_path_bytes"] / max(1, full["full_cycles"]),
            "full_path_bytes_per_rank_message": full["full_path_bytes"] / max(1, full["full_cycles"]) / hvd.size(),
            "bitvector_bytes_per_cycle_per_rank": cached["bitvector_bytes"] / max(1, cached["cycles"]),
            "cached_cycle_ms": 1000 * cached["seconds"] / max(1, cached["cycles"]),
            "cached_step_ms": 1000 * cached["seconds"] / steps,
            "cached_full_rounds": cached["full_cycles"],
            "full_cycle_ms": 1000 * full["seconds"] / max(1, full["cycles"]),
            "full_step_ms": 1000 * full["seconds"] / max(1, steps // 4),
        }), flush=True)
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16,32,64")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tensors, args.steps)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        cmd = ["mpiexec", "-n", str(n), "-bind-to", "none", sys.executable, __file__, "--worker",
               "--tensors", str(args.tensors), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        results.append(json.loads(lines[0][7:]))
    print(json.dumps({"benchmark": "negotiation_scale", "cpus": os.cpu_count(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
