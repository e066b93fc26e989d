"""examples/pytorch_synthetic_benchmark.py with hvdlite.torch and with Horovod, in alternating rounds of one run.

    python benchmarks/synthetic_vs_horovod.py --horovod-venv /work/venv-hvd \\
        --out benchmarks/results/synthetic_vs_horovod.json                      # ~3 min on 2 cores

Each round launches the example twice at --np ranks, once with ``--hvd-module hvdlite.torch`` and once with
``--hvd-module horovod.torch`` (--peer-module), in fresh processes, the order swapped every round. Both use the
same Python and mpiexec (the Horovod venv's; hvdlite from this checkout through PYTHONPATH). The example's
flags after ``--`` replace the defaults below (ResNet-50 at 64x64, batch 8 per rank: minutes on 2 CPU cores;
Horovod's own defaults are ResNet-50 at 224x224, batch 32). One JSON line per launch (total img/sec over all
ranks as the example prints it, each timed iteration's img/sec per rank, and the CPU seconds of all its
processes, start-up included); a summary with the median of each side, the ratio hvdlite / peer of the medians,
the median of the per-round ratios and each side's median CPU seconds (the same work on both sides: under
load from other jobs, a library whose threads poll while they wait is scheduled more, so compare CPU too).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

EXAMPLE = _common.ROOT / "examples" / "pytorch_synthetic_benchmark.py"
DEFAULT_EXAMPLE_ARGS = ["--model", "resnet50", "--batch-size", "8", "--image-size", "64",
                        "--num-warmup-batches", "2", "--num-batches-per-iter", "5", "--num-iters", "3"]


def launch(python: str, mpiexec: str, module: str, args: argparse.Namespace, example_args: list[str]) -> dict[str, Any]:
    cmd = [mpiexec, "-n", str(args.np), python, str(EXAMPLE), "--hvd-module", module, *example_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher waits for its ranks: theirs included
    total = re.findall(r"^total_samples_per_sec=([0-9.]+)$", proc.stdout, flags=re.M)
    if proc.returncode != 0 or len(total) != 1:
        raise SystemExit(f"synthetic_vs_horovod.py: {' '.join(cmd)} exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    iters = [float(x) for x in re.findall(r"^Iter #\d+: ([0-9.]+) img/sec per", proc.stdout, flags=re.M)]
    return {"bench": "synthetic_vs_horovod", "kind": "run", "module": module, "ranks": args.np,
            "total_img_per_s": float(total[0]), "iter_img_per_s_per_rank": iters, "loadavg_1min": round(load, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    example_args = DEFAULT_EXAMPLE_ARGS
    if "--" in argv:
        i = argv.index("--")
        argv, example_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="launches per side, alternating (median reported)")
    p.add_argument("--horovod-venv", default="", help="the venv with Horovod: its Python and mpiexec run both sides")
    p.add_argument("--peer-module", default="horovod.torch", help="the module compared with hvdlite.torch")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per launch")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    python = str(Path(args.horovod_venv).resolve() / "bin" / "python") if args.horovod_venv else sys.executable
    mpiexec = _common.mpiexec_beside(python)
    check = subprocess.run([python, "-c", f"import {args.peer_module}"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(_common.ROOT)))
    if check.returncode != 0:
        raise SystemExit(f"synthetic_vs_horovod.py: {python} cannot import {args.peer_module} (give --horovod-venv "
                         f"VENV built with ../shared/peers/build-horovod.sh):\n{check.stderr[-1000:]}")
    output = _common.Output(0, args.out)
    output.emit({**_common.machine_info("synthetic_vs_horovod", args.np), "worker_python": python,
                 "peer_module": args.peer_module, "example_args": example_args, "rounds": args.rounds})
    sides = {"hvdlite": "hvdlite.torch", "peer": args.peer_module}
    runs: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    pair_ratios = []
    for r in range(args.rounds):
        got = {}
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            record = {"side": side, **launch(python, mpiexec, sides[side], args, example_args), "round": r}
            output.emit(record)
            got[side] = record["total_img_per_s"]
            runs[side].append(record["total_img_per_s"])
            cpu[side].append(record["cpu_s"])
        pair_ratios.append(got["hvdlite"] / got["peer"])
    medians = {side: statistics.median(values) for side, values in runs.items()}
    output.emit({"bench": "synthetic_vs_horovod", "kind": "summary", "ranks": args.np, "rounds": args.rounds,
                 "hvdlite_img_per_s": medians["hvdlite"], "peer_img_per_s": medians["peer"],
                 "peer_module": args.peer_module, "hvdlite_over_peer": medians["hvdlite"] / medians["peer"],
                 "median_round_ratio": statistics.median(pair_ratios), "round_ratios": pair_ratios,
                 "hvdlite_cpu_s": statistics.median(cpu["hvdlite"]), "peer_cpu_s": statistics.median(cpu["peer"]),
                 "loadavg_1min_end": round(os.getloadavg()[0], 2)})
    output.close()


if __name__ == "__main__":
    main()
