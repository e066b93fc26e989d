"""Optimizer-state bytes and peak RSS per rank: hvd.ZeroRedundancyOptimizer against hvd.DistributedOptimizer.

    python benchmarks/lab/zero_memory.py --ranks 1,2,4 --out benchmarks/results/zero_memory.json   # ~3 min

The driver launches ``mpiexec -n N`` of this script (``--worker``) once per optimizer and rank count. Each
worker holds the parameters of BERT-base (199 tensors, 109.5M float32; ``--model``, ``--scale`` for smoke
runs), gives them random gradients and takes ``--steps`` AdamW steps. Rank 0 prints one JSON line per job:
the optimizer-state bytes and the peak RSS (ru_maxrss) of every rank. A last line compares them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import ROOT, machine_info  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch

    import hvdlite.torch as hvd
    from shapes import gradient_shapes, scaled_shapes

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.size()))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in scaled_shapes(gradient_shapes(args.model),
                                                                                 args.scale)]
    rss_params = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if args.optimizer == "zero":
        opt = hvd.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-4)
        states = lambda: opt.optim.state.values()  # noqa: E731
    else:
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(params, lr=1e-4))
        states = lambda: opt.state.values()  # noqa: E731
    began = time.perf_counter()
    for _ in range(args.steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    seconds = (time.perf_counter() - began) / args.steps
    state_bytes = sum(v.numel() * v.element_size() for s in states() for k, v in s.items()
                      if torch.is_tensor(v) and k != "step")
    mine = {"rank": hvd.rank(), "state_bytes": state_bytes, "peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_params_mb": rss_params / 1024}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        model_bytes = sum(p.numel() * p.element_size() for p in params)
        print(json.dumps({"bench": "zero_memory", "optimizer": args.optimizer, "ranks": hvd.size(),
                          "model": args.model, "model_bytes": model_bytes, "step_s": round(seconds, 3),
                          "per_rank": every}), flush=True)
    hvd.shutdown()


def driver(args: argparse.Namespace) -> None:
    records = []
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    header = machine_info("zero_memory", 0, model=args.model, scale=args.scale, steps=args.steps)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    emit(header)
    for n in [int(x) for x in args.ranks.split(",")]:
        for optimizer in ("dist", "zero"):
            cmd = ["mpiexec", "-n", str(n), sys.executable, __file__, "--worker", "--optimizer", optimizer,
                   "--model", args.model, "--scale", str(args.scale), "--steps", str(args.steps)]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                             os.environ.get("PYTHONPATH")])))
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            record = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
            records.append(record)
            emit(record)
    summary = {"bench": "zero_memory", "kind": "summary", "rows": []}
    for n in sorted({r["ranks"] for r in records}):
        by = {r["optimizer"]: r for r in records if r["ranks"] == n}
        dist_state = max(p["state_bytes"] for p in by["dist"]["per_rank"])
        zero_state = max(p["state_bytes"] for p in by["zero"]["per_rank"])
        summary["rows"].append({
            "ranks": n, "state_mb_dist": round(dist_state / 2**20, 1), "state_mb_zero": round(zero_state / 2**20, 1),
            "state_ratio": round(zero_state / dist_state, 4),
            "peak_rss_mb_dist": round(max(p["peak_rss_mb"] for p in by["dist"]["per_rank"]), 1),
            "peak_rss_mb_zero": round(max(p["peak_rss_mb"] for p in by["zero"]["per_rank"]), 1),
            "step_s_dist": by["dist"]["step_s"], "step_s_zero": by["zero"]["step_s"]})
    emit(summary)
    if out:
        out.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="internal: run as one rank of a job")
    parser.add_argument("--optimizer", choices=("zero", "dist"), default="zero")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated job sizes")
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every tensor (smoke runs)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
