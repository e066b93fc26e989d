"""Autotune from deliberately bad settings against hand-set configurations, on ResNet-50's gradient shapes.

Run:   mpiexec -n 2 python benchmarks/lab/autotune.py [--out benchmarks/results/autotune.json]
Smoke: mpiexec -n 2 python benchmarks/lab/autotune.py --scale 0.001 --reps 2 --rounds 1 --max-samples 3

Phase 1 starts hvdlite with fusion off and 64 MiB chunks and HVDLITE_AUTOTUNE=1, then runs ResNet-50-style
gradient synchronisation steps (allreduce_async_ of all 161 tensors in backprop order, Average, then
synchronize, as DistributedOptimizer does) until autotune has made its final choice. Phase 2 measures, in
interleaved rounds (hvdlite re-initialised for each configuration, so load from elsewhere hits all alike), the
bad start, a grid of hand-set configurations and the autotuned choice: the slowest rank's time per step,
median over rounds x repetitions. JSON lines: a machine line, one line per configuration, a summary with the
ratio autotuned / best hand-set (the goal: at most 1.10).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402

MIB = 1 << 20
BAD = {"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 64 * MIB}
HAND_SET = {
    "default_4MB_1ms_1MB": {"fusion_threshold_bytes": 4 * MIB, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 1 * MIB},
    "fusion16MB_chunk2MB": {"fusion_threshold_bytes": 16 * MIB, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 2 * MIB},
    "fusion64MB_chunk4MB": {"fusion_threshold_bytes": 64 * MIB, "cycle_time_ms": 1.0,
                            "allreduce_chunk_bytes": 4 * MIB},
    "fusion4MB_chunk256KB": {"fusion_threshold_bytes": 4 * MIB, "cycle_time_ms": 1.0,
                             "allreduce_chunk_bytes": MIB // 4},
    "fusion8MB_cycle0.2_chunk2MB": {"fusion_threshold_bytes": 8 * MIB, "cycle_time_ms": 0.2,
                                    "allreduce_chunk_bytes": 2 * MIB},
    "fusion32MB_cycle5_chunk1MB": {"fusion_threshold_bytes": 32 * MIB, "cycle_time_ms": 5.0,
                                   "allreduce_chunk_bytes": 1 * MIB},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50", help="gradient shapes of this model (benchmarks/shapes.py)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every tensor to this fraction (smoke runs)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the configurations")
    p.add_argument("--reps", type=int, default=5, help="timed steps per configuration and round")
    # autotune's own defaults (Config): a smaller budget scores samples on too few steps (see README)
    p.add_argument("--warmup-samples", type=int, default=3, help="autotune warmup samples")
    p.add_argument("--steps-per-sample", type=int, default=10, help="autotune steps per sample")
    p.add_argument("--max-samples", type=int, default=20, help="autotune samples scored")
    p.add_argument("--max-tuning-steps", type=int, default=400, help="give up tuning after this many steps")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


class Grads:
    def __init__(self, model: str, scale: float) -> None:
        from shapes import gradient_shapes, scaled_shapes
        self.shapes = scaled_shapes(gradient_shapes(model), scale)[::-1]  # backprop order
        self.arrays = [np.ones(s, dtype=np.float32) for s in self.shapes]
        self.names = [f"grad.{i}" for i in range(len(self.shapes))]
        self.nbytes = sum(4 * math.prod(s) for s in self.shapes)

    def step(self) -> None:
        handles = [hvd.allreduce_async_(a, name=n, op=hvd.Average) for a, n in zip(self.arrays, self.names)]
        for h in handles:
            hvd.synchronize(h)


def tune(args: argparse.Namespace, grads: Grads) -> dict[str, Any]:
    hvd.init(autotune=True, autotune_warmup_samples=args.warmup_samples,
             autotune_steps_per_sample=args.steps_per_sample, autotune_bayes_opt_max_samples=args.max_samples,
             **BAD)
    tuner = hvd.core.runtime.state().engine.observer.autotune
    start, steps = time.perf_counter(), 0
    done = np.zeros(1, dtype=np.int32)
    while steps < args.max_tuning_steps:
        grads.step()
        steps += 1
        done[0] = tuner.final is not None
        if hvd.allreduce(done, op=hvd.Min, name="tuned")[0]:  # every rank has switched to the final choice
            break
    seconds = time.perf_counter() - start
    chosen = dict(tuner.final or tuner.settings())
    hvd.shutdown()
    return {"chosen": chosen, "tuning_steps": steps, "tuning_seconds": seconds, "finished": bool(done[0])}


def measure(args: argparse.Namespace, grads: Grads, comm: Any, configs: dict[str, dict[str, Any]]) -> dict:
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, settings in configs.items():
            hvd.init(**settings)
            grads.step()  # warm the response cache and buffers
            for _ in range(args.reps):
                times[name].append(_common.timed(comm, grads.step))
            hvd.shutdown()
    out = {}
    for name, series in times.items():
        out[name] = _common.summarize(comm, _common.Series(name, series))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    output = _common.Output(comm.Get_rank(), args.out)
    grads = Grads(args.model, args.scale)
    output.emit(_common.machine_info("autotune", comm.Get_size(), model=args.model, scale=args.scale,
                                     rounds=args.rounds, reps=args.reps, tensors=len(grads.shapes),
                                     bytes=grads.nbytes, warmup_samples=args.warmup_samples,
                                     steps_per_sample=args.steps_per_sample, max_samples=args.max_samples))
    tuned = tune(args, grads)
    output.emit({"bench": "autotune", "kind": "tuning", "start": BAD, **tuned})
    configs = {"bad_start": BAD, **HAND_SET, "autotuned": tuned["chosen"]}
    results = measure(args, grads, comm, configs)
    for name, res in results.items():
        output.emit({"bench": "autotune", "kind": "config", "config": name, "settings": configs[name], **res,
                     "bytes_per_s": grads.nbytes / (res["ms"] / 1e3)})
    best_hand = min(HAND_SET, key=lambda n: results[n]["ms"])
    ratio = results["autotuned"]["ms"] / results[best_hand]["ms"]
    output.emit({"bench": "autotune", "kind": "summary", "best_hand_set": best_hand,
                 "best_hand_set_ms": results[best_hand]["ms"], "autotuned_ms": results["autotuned"]["ms"],
                 "bad_start_ms": results["bad_start"]["ms"], "autotuned_over_best_hand_set": ratio,
                 "within_10_percent": ratio <= 1.10,
                 "median_ratio_all_hand_set": statistics.median(results[n]["ms"] for n in HAND_SET)
                 / results["autotuned"]["ms"]})
    output.close()


if __name__ == "__main__":
    main()
