"""bf16 on the wire, float32 sums (Compression.bf16_fp32acc) against fp32 and bf16 allreduce: error, bytes, time,
convergence. One run prints JSON lines (and writes them to --out); it launches its own mpiexec jobs.

Run:   python benchmarks/lab/bf16_accumulation.py [--out benchmarks/results/bf16_accumulation.json]
Smoke: python benchmarks/lab/bf16_accumulation.py --smoke

1. Error (``kind: "precision"``): each rank's gradient is shaped like ResNet-50's and the small transformer's
   (benchmarks/shapes.py's layers, plain torch; ``--elements`` elements sampled across all layers, per-layer
   scales and heavy tails: see model_like), or adversarial: many small values plus one rank's large value at a
   few elements (``adversarial``), or large values that cancel between two ranks (``cancelling``). Real
   ``mpiexec -n N`` jobs (oversubscribed on a small machine) average them with:
   ``fp32`` (MPI's float32 allreduce), ``bf16`` (Horovod's Compression.bf16: cast, reduce in bfloat16 by MPI's
   algorithm, divide), ``bf16_ring`` (the same in rank order, N-1 roundings per element as a ring allreduce
   does: hvdlite's deterministic=True), ``bf16_fp32acc`` and ``bf16_fp32acc_fp32gather``, and the fp16 pair
   (``fp16``, ``fp16_fp32acc``). Reported: the relative L2 error and the largest error (relative to the
   largest value) of the average against a float64 reference, and ``floor``: the reference itself rounded to
   the method's result dtype (no method returning that dtype can do better).
2. Bytes (in each precision record): what each rank sends in a bandwidth-optimal allreduce of that dtype
   (2 (N-1)/N x the buffer) and, for the accumulating methods, the all-to-all plus the all-gather it runs.
3. Time (``kind: "time"``, -n 2): hvd.grouped_allreduce of ResNet-50's 161 gradient tensors (25.6M floats) with
   each compression, casts included, through hvdlite.torch.
4. Convergence (``kind: "converge"``, -n 4): an MLP on sklearn's digits, DistributedOptimizer with Compression.none,
   .bf16 and .bf16_fp32acc from the same start: training loss per epoch and test accuracy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import ROOT, Output  # noqa: E402

ERROR_METHODS = ("fp32", "bf16", "bf16_ring", "bf16_fp32acc", "bf16_fp32acc_fp32gather", "fp16", "fp16_fp32acc")
TIME_METHODS = ("none", "bf16", "bf16_fp32acc", "bf16_fp32acc_fp32gather", "fp16", "fp16_fp32acc")
CONVERGE_METHODS = ("none", "bf16", "bf16_fp32acc")
DISTRIBUTIONS = ("resnet50", "small-transformer", "adversarial", "cancelling")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="also write the JSON lines here")
    p.add_argument("--ranks", default="2,4,8,16,32,64", help="job sizes of the error runs")
    p.add_argument("--elements", type=int, default=1 << 17, help="gradient elements per distribution")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--time-scale", type=float, default=1.0, help="fraction of ResNet-50's size for the timing")
    p.add_argument("--epochs", type=int, default=8, help="convergence epochs")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, -n 2 only: checks that it runs")
    p.add_argument("--worker", choices=("error", "time", "converge"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.ranks, args.elements, args.reps, args.time_scale, args.epochs = "2", 4096, 1, 0.002, 1
    return args


# -- the gradients ------------------------------------------------------------------------------------
def model_like(model: str, ranks: int, elements: int) -> np.ndarray:
    """``ranks`` rows shaped like the model's gradient (benchmarks/shapes.py, plain torch on the meta device):
    ``elements`` positions sampled uniformly over its parameters (each layer by its share); in each layer a
    shared mean (the signal) plus each rank's own noise, twice as large (small-batch SGD), both with Student-t
    tails (3 degrees of freedom), the layer's scale drawn log-uniformly over 1e-5..1e-2 (layers' gradients
    differ by orders of magnitude). A real backward per rank (64 of ResNet-50) does not fit this machine."""
    from shapes import gradient_shapes
    sizes = np.array([int(np.prod(shape)) for shape in gradient_shapes(model)], dtype=np.int64)
    rng = np.random.default_rng(1)
    picks = np.sort(rng.choice(int(sizes.sum()), size=min(elements, int(sizes.sum())), replace=False))
    layer = np.searchsorted(np.cumsum(sizes), picks, side="right")
    scale = (10.0 ** rng.uniform(-5, -2, size=sizes.size))[layer]
    mean = scale * rng.standard_t(3, size=picks.size)
    noise = 2.0 * scale * rng.standard_t(3, size=(ranks, picks.size))
    return (mean + noise).astype(np.float32)


def adversarial(ranks: int, elements: int) -> np.ndarray:
    """Many small values (about 1e-3, positive, so they add up) and, at 1% of the elements, one rank's large
    value (0.5..2, on rank 0 or 1, so that every job size has them): a reduction in bf16 drops each small
    addend that meets a large partial sum (bf16's step at 1.0 is 2**-7), so the loss grows with the ranks."""
    rng = np.random.default_rng(7)
    rows = (1e-3 * (1.0 + 0.1 * rng.standard_normal((ranks, elements)))).astype(np.float32)
    big = rng.choice(elements, size=max(1, elements // 100), replace=False)
    rows[rng.integers(0, 2, size=big.size), big] = rng.uniform(0.5, 2.0, size=big.size)
    return rows


def cancelling(ranks: int, elements: int) -> np.ndarray:
    """Small values everywhere (|x| ~ 1e-3), and at 1% of the elements +L on rank 0 and -L on rank 1
    (L ~ 1e2): the large values cancel, and the answer is the small ones, which no bf16 wire carries on top
    of L (each contribution is rounded to bf16 before any sum): the limit of every bf16 method."""
    rng = np.random.default_rng(8)
    rows = (rng.standard_normal((ranks, elements)) * 1e-3).astype(np.float32)
    big = rng.choice(elements, size=max(1, elements // 100), replace=False)
    large = (rng.uniform(50, 150, size=big.size) * rng.choice([-1, 1], size=big.size)).astype(np.float32)
    rows[0, big] += large
    rows[1, big] -= large
    return rows


# -- worker: error ------------------------------------------------------------------------------------
def sent_bytes(method: str, n: int, ranks: int) -> int:
    """Bytes each rank sends to average ``n`` elements: a bandwidth-optimal allreduce moves 2 (N-1)/N of the
    buffer; the accumulating ones an all-to-all of the wire dtype plus an all-gather of the gather dtype."""
    share = (ranks - 1) / ranks
    if method == "fp32":
        return int(2 * share * 4 * n)
    if method.endswith("fp32gather"):
        return int(share * 2 * n + share * 4 * n)
    return int(2 * share * 2 * n)


def error_worker(args: argparse.Namespace) -> None:
    import hvdlite.core as hvd
    from hvdlite.core.reduce_ops import Accumulation, bf16_to_f32, f32_to_bf16
    from _common import machine_info
    acc = {"bf16_fp32acc": Accumulation("bfloat16", "bfloat16"), "fp16_fp32acc": Accumulation("float16", "float16"),
           "bf16_fp32acc_fp32gather": Accumulation("bfloat16", "float32")}
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = Output(rank, None)
    if size == 2:
        out.emit(machine_info("bf16_accumulation", size, part="error"))
    results: dict[tuple[str, str], np.ndarray] = {}
    rows = {d: np.load(Path(args.data, f"{d}.npy"), mmap_mode="r") for d in DISTRIBUTIONS}
    for phase in ("default", "deterministic"):
        if phase == "deterministic":
            hvd.shutdown()
            hvd.init(deterministic=True)
        for dist in DISTRIBUTIONS:
            mine = np.array(rows[dist][rank], dtype=np.float32)
            for method in ERROR_METHODS:
                if (method == "bf16_ring") != (phase == "deterministic"):
                    continue
                name = f"{dist}.{method}"
                if method == "fp32":
                    got = hvd.allreduce(mine, op=hvd.Average, name=name)
                elif method in ("bf16", "bf16_ring"):
                    got = bf16_to_f32(hvd.allreduce_async(f32_to_bf16(mine), op=hvd.Average, name=name,
                                                          dtype_hint="bfloat16").wait())
                elif method == "fp16":
                    got = hvd.allreduce(mine.astype(np.float16), op=hvd.Average, name=name).astype(np.float32)
                else:
                    got = hvd.grouped_allreduce([mine], op=hvd.Average, name=name, accumulation=acc[method])[0]
                results[(dist, method)] = np.asarray(got, dtype=np.float32)
    if rank == 0:
        for dist in DISTRIBUTIONS:
            ref = np.asarray(rows[dist][:size], dtype=np.float64).mean(axis=0)
            norm, peak = float(np.linalg.norm(ref)), float(np.abs(ref).max())
            floors = {"bf16": bf16_to_f32(f32_to_bf16(ref.astype(np.float32))).astype(np.float64),
                      "fp16": ref.astype(np.float16).astype(np.float64), "fp32": ref.astype(np.float32)}
            for method in ERROR_METHODS:
                err = results[(dist, method)].astype(np.float64) - ref
                result_dtype = "fp32" if method in ("fp32", "bf16_fp32acc_fp32gather") else method[:4]
                out.emit({"bench": "bf16_accumulation", "kind": "precision", "distribution": dist, "ranks": size,
                          "method": method, "elements": int(ref.size), "rel_l2": float(np.linalg.norm(err)) / norm,
                          "max_rel": float(np.abs(err).max()) / peak, "result_dtype": result_dtype,
                          "floor_rel_l2": float(np.linalg.norm(floors[result_dtype] - ref)) / norm,
                          "bytes_sent_per_rank": sent_bytes(method, ref.size, size)})
    hvd.shutdown()


# -- worker: time -------------------------------------------------------------------------------------
def time_worker(args: argparse.Namespace) -> None:
    import torch
    import hvdlite.torch as hvd
    from _common import machine_info
    from shapes import gradient_shapes, scaled_shapes
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = Output(rank, None)
    out.emit(machine_info("bf16_accumulation", size, part="time"))
    shapes = scaled_shapes(gradient_shapes("resnet50"), args.time_scale)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    elements = sum(g.numel() for g in grads)
    comm = __import__("mpi4py").MPI.COMM_WORLD
    times: dict[str, list[float]] = {m: [] for m in TIME_METHODS}
    for rep in range(args.reps + 1):  # methods interleaved, so load changes hit all of them alike
        for method in TIME_METHODS:
            compression = getattr(hvd.Compression, method)
            comm.Barrier()
            start = time.perf_counter()
            hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression, name=f"t.{method}")
            elapsed = time.perf_counter() - start
            if rep:
                times[method].append(comm.allreduce(elapsed, op=__import__("mpi4py").MPI.MAX))
    medians = {m: float(np.median(t)) * 1e3 for m, t in times.items()}
    for method in TIME_METHODS:
        ms = sorted(t * 1e3 for t in times[method])
        out.emit({"bench": "bf16_accumulation", "kind": "time", "ranks": size, "method": method,
                  "tensors": len(grads), "elements": elements, "ms": medians[method], "ms_min": ms[0],
                  "ms_max": ms[-1], "reps": len(ms), "vs_fp32": medians[method] / medians["none"],
                  "vs_bf16": medians[method] / medians["bf16"]})
    hvd.shutdown()


# -- worker: convergence ------------------------------------------------------------------------------
def converge_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    import hvdlite.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = Output(rank, None)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    mine = train[rank::size]
    reference: Any = None  # Compression.none's final weights
    for method in CONVERGE_METHODS:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                       net.named_parameters(), compression=getattr(hvd.Compression, method))
        losses = []
        for epoch in range(args.epochs):
            perm = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch * size + rank))]
            total, batches = 0.0, 0
            for start in range(0, len(perm) - 15, 16):
                idx = perm[start:start + 16]
                opt.zero_grad()
                loss = F.cross_entropy(net(x[idx]), y[idx])
                loss.backward()
                opt.step()
                total, batches = total + float(loss), batches + 1
            losses.append(float(hvd.allreduce(torch.tensor(total / batches), name=f"loss.{method}.{epoch}")))
        with torch.no_grad():
            accuracy = float((net(x[test]).argmax(1) == y[test]).float().mean())
        weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()
        reference = weights if reference is None else reference
        out.emit({"bench": "bf16_accumulation", "kind": "converge", "ranks": size, "method": method,
                  "epochs": args.epochs, "train_loss": losses, "test_accuracy": accuracy,
                  "weights_rel_diff_vs_fp32": float((weights - reference).norm() / reference.norm())})
    hvd.shutdown()


# -- the driver ---------------------------------------------------------------------------------------
def launch(n: int, argv: list[str], timeout: float) -> list[dict[str, Any]]:
    mpiexec = os.environ.get("MPIEXEC", "mpiexec")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HVDLITE_STALL_CHECK_TIME_SECONDS="600", HVDLITE_STALL_SHUTDOWN_TIME_SECONDS="0",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, __file__, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"mpiexec -n {n} {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(args: argparse.Namespace) -> None:
    out = Output(0, args.out)
    began = time.perf_counter()
    ranks = [int(r) for r in args.ranks.split(",")]
    base = ["--elements", str(args.elements), "--reps", str(args.reps), "--time-scale", str(args.time_scale),
            "--epochs", str(args.epochs)]
    with tempfile.TemporaryDirectory() as data:
        made = time.perf_counter()
        for dist in DISTRIBUTIONS:
            make = {"adversarial": adversarial, "cancelling": cancelling}.get(dist)
            rows = make(max(ranks), args.elements) if make else model_like(dist, max(ranks), args.elements)
            np.save(Path(data, f"{dist}.npy"), rows)
        out.emit({"bench": "bf16_accumulation", "kind": "gradients", "elements": args.elements,
                  "max_ranks": max(ranks), "seconds": time.perf_counter() - made})
        for n in ranks:
            started = time.perf_counter()
            for record in launch(n, ["--worker", "error", "--data", data, *base], timeout=1800):
                out.emit(record)
            out.emit({"bench": "bf16_accumulation", "kind": "precision_run", "ranks": n,
                      "seconds": time.perf_counter() - started})
    for record in launch(2, ["--worker", "time", *base], timeout=1800):
        out.emit(record)
    for record in launch(2 if args.smoke else 4, ["--worker", "converge", *base], timeout=1800):
        out.emit(record)
    out.emit({"bench": "bf16_accumulation", "kind": "done", "seconds": time.perf_counter() - began})
    out.close()


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker is None:
        main(parsed)
    else:
        {"error": error_worker, "time": time_worker, "converge": converge_worker}[parsed.worker](parsed)
