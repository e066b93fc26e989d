"""What adding a host costs an elastic torch job at -n 2 -> 3 under Open MPI 5 with ULFM: the restart path hvdlite
uses (the ranks commit and leave, the job starts again at the new size) against in-process growth with
``Comm.Spawn`` + ``Intercomm.Merge`` (what Open MPI 5.0 offers; hvdlite does not use it, see docs/elastic.md,
"Growth"), and whether a job grown by Spawn still recovers in-process when one of its first ranks dies.

Run:   python benchmarks/lab/elastic_growth.py --ompi-python VENV/bin/python [--rounds 2]

``--ompi-python``: a Python whose mpi4py loads pip's Open MPI 5 (the tests' ``ompi_python`` fixture makes one).
Both paths use the model of benchmarks/elastic_recovery.py (a 3-layer MLP of hidden width --width, default 1024:
1.1 M parameters, torch CPU, batch 8 per rank) and this machine as the added "host" (a third slot on localhost).

- ``restart``: hvdlite-run (in-process mode, chosen by itself) runs tests/workers/elastic_inprocess.py on 2 slots
  of a discovery script; once training runs the script lists 3. Timed from that change (and from the driver's
  "hosts changed" line, about a second later: discovery runs once a second) to rank 0's first completed step at
  size 3: the next commit, the ranks leaving, a new job (Python, ``import torch``, MPI_Init, the model, the
  commit read back), its first step.
  Split at the driver's "starting 3 ranks" line: the commit and the old job's end, then the new job's start.
- ``spawn``: ``mpiexec -n 2`` of this file (``--spawn-program``): after a step, the two ranks ``Spawn`` one new
  process (it imports torch and builds the model), ``Merge``, broadcast the model's state from rank 0 and run a
  step on 3 ranks (forward, backward, an allreduce of the gradients). Timed from the Spawn call to that step
  (``Spawn`` returns once the process is started; ``Merge`` waits for it to reach MPI: its imports).
- ``spawn_then_loss``: the same, then one rank dies (``--lose R``: 1 is one of the first two ranks, 2 the spawned
  one; ``lost_by``: SIGKILL, or ``os._exit(9)``, an exit with a non-zero status) and the others revoke, shrink and
  run a barrier; ``recovered`` says whether they did (a hung job is ended after 90 s).

Prints JSON lines: one per run and a summary with the medians (``kind``: summary).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common  # noqa: E402

WORKER = str(_common.ROOT / "tests" / "workers" / "elastic_inprocess.py")
ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "mpi_ft_detector", "true",
        "--mca", "async_mpi_finalize", "true", "--host", "localhost:4", "--bind-to", "none"]
LOSS_TIMEOUT_S = 30.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    return env


def restart(python: str, args: argparse.Namespace) -> dict[str, Any]:
    """One hvdlite-run job that discovery grows from 2 to 3 slots once its first step is done."""
    with tempfile.TemporaryDirectory() as tmp:
        listing, script = Path(tmp, "hosts"), Path(tmp, "discover.sh")
        listing.write_text("localhost:2\n")
        script.write_text(f"#!/bin/sh\ncat {listing}\n")
        script.chmod(0o755)
        cmd = [python, "-m", "hvdlite.run", "-np", "2", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", str(script), python, WORKER, "--epochs", str(args.epochs),
               "--samples", str(args.samples), "--width", str(args.width), "--sleep", "0.05"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                cwd=_common.ROOT, start_new_session=True)
        assert proc.stdout is not None
        lines: list[str] = []
        flipped = changed = started = 0.0
        for line in proc.stdout:
            lines.append(line)
            if not flipped and line.startswith("first_step entry=1 size=2 "):
                listing.write_text("localhost:3\n")
                flipped = time.time()
            elif flipped and not changed and "hosts changed" in line:
                changed = time.time()
            elif changed and not started and "starting 3 ranks" in line:
                started = time.time()
        code = proc.wait()
    out = "".join(lines)
    step = re.search(r"^first_step entry=\d+ size=3 t=([\d.]+)", out, re.MULTILINE)
    if code != 0 or step is None or not changed:
        raise SystemExit(f"restart run failed ({code}):\n{out[-4000:]}")
    return {"kind": "restart", "discovery_to_step_s": round(float(step.group(1)) - flipped, 3),
            "hosts_changed_to_step_s": round(float(step.group(1)) - changed, 3),
            "hosts_changed_to_new_job_s": round(started - changed, 3),
            "new_job_to_step_s": round(float(step.group(1)) - started, 3)}


def spawn(python: str, args: argparse.Namespace, lose: Optional[int], by: str = "kill",
          retry: bool = True) -> dict[str, Any]:
    """One ``mpiexec -n 2`` job of --spawn-program that spawns a third rank (and then loses rank ``lose``)."""
    mpiexec = str(Path(python).parent / "mpiexec")
    cmd = [mpiexec, *ULFM, "-n", "2", python, __file__, "--spawn-program", "--width", str(args.width)]
    if lose is not None:
        cmd += ["--lose", str(lose), "--lose-by", by]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            cwd=_common.ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LOSS_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:  # hung (the loss of a first rank): let prterun clean up, then kill
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    if "listener thread failed to start" in out and retry:  # (once, after a killed run: a transient start failure)
        return spawn(python, args, lose, by, retry=False)
    grown = re.search(r"^grown spawn_s=([\d.]+) merge_s=([\d.]+) to_step_s=([\d.]+)", out, re.MULTILINE)
    if grown is None:
        raise SystemExit(f"spawn run failed ({proc.returncode}):\n{out[-4000:]}")
    run: dict[str, Any] = {"kind": "spawn" if lose is None else "spawn_then_loss",
                           "spawn_s": float(grown.group(1)), "merge_s": float(grown.group(2)),
                           "spawn_to_step_s": float(grown.group(3))}
    if lose is not None:
        run["lost_rank"], run["lost_by"] = lose, by
        run["recovered"] = len(re.findall(r"^recovered size=2", out, re.MULTILINE)) == 2
        run["errors"] = sorted(set(re.findall(r"PRTE ERROR: [^\n]*", out)))
    return run


def spawn_program(args: argparse.Namespace) -> None:
    """Inside Open MPI: the job's ranks (or the spawned one) train a step of the MLP on a merged communicator."""
    from mpi4py import MPI
    import numpy as np
    import torch
    import torch.nn.functional as F
    parent = MPI.Comm.Get_parent()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(16, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def step(comm: Any) -> None:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        flat = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
        comm.Allreduce(MPI.IN_PLACE, flat)

    if parent == MPI.COMM_NULL:
        world = MPI.COMM_WORLD
        step(world)  # training runs on the first two ranks
        world.Barrier()
        t0 = time.time()
        inter = world.Spawn(sys.executable, [__file__, *sys.argv[1:]], maxprocs=1, root=0)
        t1 = time.time()
        merged = inter.Merge(high=False)
        t2 = time.time()
    else:
        merged = parent.Merge(high=True)
    state = merged.bcast({k: v.numpy() for k, v in model.state_dict().items()} if merged.rank == 0 else None, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    step(merged)
    if parent == MPI.COMM_NULL and merged.rank == 0:
        print(f"grown spawn_s={t1 - t0:.3f} merge_s={t2 - t1:.3f} to_step_s={time.time() - t0:.3f}", flush=True)
    if args.lose is None:
        merged.Barrier()
        return
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    merged.Barrier()
    time.sleep(0.3)  # every rank is past the barrier
    if merged.rank == args.lose:  # a death by a signal (kill -9, a segfault) or an exit with a non-zero status
        os.kill(os.getpid(), signal.SIGKILL) if args.lose_by == "kill" else os._exit(9)
    try:
        while True:
            merged.Allreduce(MPI.IN_PLACE, np.ones(1))
            time.sleep(0.05)
    except MPI.Exception:
        merged.Revoke()
        shrunk = merged.Shrink()
        shrunk.Barrier()
        print(f"recovered size={shrunk.Get_size()}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ompi-python", default="")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--spawn-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lose", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lose-by", choices=("kill", "exit"), default="kill", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.spawn_program:
        spawn_program(args)
        return
    if not args.ompi_python:
        p.error("--ompi-python is required")
    runs: list[dict[str, Any]] = []
    for _ in range(args.rounds):  # alternate, so load from elsewhere hits every variant alike
        py = args.ompi_python
        for measure in (lambda: restart(py, args), lambda: spawn(py, args, None), lambda: spawn(py, args, 1, "kill"),
                        lambda: spawn(py, args, 1, "exit"), lambda: spawn(py, args, 2, "kill")):
            runs.append(measure())
            print(json.dumps(runs[-1]), flush=True)

    def med(kind: str, key: str) -> float:
        values = [r[key] for r in runs if r["kind"] == kind]
        return statistics.median(values) if values else float("nan")

    def recovered(lost: int, by: str) -> str:
        tried = [r for r in runs if r["kind"] == "spawn_then_loss" and r["lost_rank"] == lost and r["lost_by"] == by]
        return f"{sum(r['recovered'] for r in tried)} of {len(tried)}"

    summary: dict[str, Any] = {
        "kind": "summary", "model": f"MLP 16-{args.width}-{args.width}-4, batch 8 per rank, torch CPU",
        "restart_discovery_to_step_s": med("restart", "discovery_to_step_s"),
        "restart_hosts_changed_to_step_s": med("restart", "hosts_changed_to_step_s"),
        "restart_hosts_changed_to_new_job_s": med("restart", "hosts_changed_to_new_job_s"),
        "restart_new_job_to_step_s": med("restart", "new_job_to_step_s"),
        "spawn_to_step_s": med("spawn", "spawn_to_step_s"), "spawn_s": med("spawn", "spawn_s"),
        "merge_s": med("spawn", "merge_s"),
        "spawned_job_recovers_from_a_first_rank_killed": recovered(1, "kill"),
        "spawned_job_recovers_from_a_first_rank_exiting_9": recovered(1, "exit"),
        "spawned_job_recovers_from_the_spawned_rank_killed": recovered(2, "kill"),
        "machine": {"cpu": _common.cpu_model(), "cores": os.cpu_count(), "loadavg_1min": os.getloadavg()[0],
                    "commit": _common.git_commit()}}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
