"""Many failures in one elastic torch job: Open MPI 5 (ULFM, in-process recovery), -np 4 --min-np 2 --max-np 4, a
discovery script that keeps listing 4 slots of this machine, and a chaos thread that, every --interval LO HI
seconds, kills a random rank of the running job with SIGKILL (or, a --stop-fraction of the time, stops one with
SIGSTOP: a hang the survivors must find) until --failures were injected; the training then runs to its end.

Run:   python benchmarks/elastic_soak.py --ompi-python VENV/bin/python [--failures 100] [--interval 5 15]
           [--stop-fraction 0.2] [--epochs 60] [--references 3]      (--failures 0: the job undisturbed)

``--ompi-python``: a Python whose mpi4py loads pip's Open MPI 5 (benchmarks/elastic_recovery.py). The job is
tests/workers/elastic_inprocess.py --soak with RECIPE. One JSON object (analyse): failures survived (named by the
driver, exit 0, every sample once an epoch, identical weights), recovery and regrowth times (REGROWTH_PHASES),
steps lost, steps/s, accuracy; --references N: N undisturbed runs of as many epochs (training seeds 0..N-1, the
soak's 0), the accuracy within their noise (their range widened by itself each way). tests/test_elastic_soak.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "elastic_inprocess.py"
JOINED = re.compile(r"rank (\d+) of (\d+) joined from host \S+ \(pid (\d+)\)")
STEP = re.compile(r"^step n=(\d+) size=(\d+) t=([\d.]+)$")
FINAL = re.compile(r"^final orig=\d+ rank=(\d+) size=(\d+) pid=(\d+) .*sha=(\w+)")
#: The training: stable over a thousand epochs undisturbed (lr per rank, x size; halved every 20 epochs to a floor).
RECIPE = ["--lr", "0.01", "--momentum", "0.9", "--weight-decay", "5e-4", "--lr-half-life", "20", "--lr-floor", "0.001"]


class Chaos:
    """The job's output, line by line, and the failures injected into its newest job's ranks."""

    def __init__(self, cmd: list[str], env: dict[str, str], args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.failures, self.interval, self.stop_fraction = args.failures, tuple(args.interval), args.stop_fraction
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.time(): the kills' and steps' clock)
        self.ranks: dict[int, int] = {}  # rank -> pid of the newest job's ranks that joined and were not hit
        self.size = 0
        self.all_joined = False  # every rank of the newest job joined (those not hit since are candidates)
        self.injected: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.log = open(args.log, "w", buffering=1) if args.log else None  # noqa: SIM115 - line by line while the job runs
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if self.log is not None:  # each line with when it arrived (the phases of a recovery or a regrowth)
                self.log.write(f"{time.time():.3f} {raw}")
            with self.lock:
                self.lines.append(line)
                self.times.append(time.time())
                if "elastic: starting" in line or "elastic: hosts changed" in line or "below --min-np" in line:
                    self.ranks, self.all_joined = {}, False  # (a job leaving or stopped: its ranks are no targets)
                elif (match := JOINED.search(line)) is not None:
                    self.ranks[int(match.group(1))] = int(match.group(3))
                    self.size = int(match.group(2))
                    self.all_joined = self.all_joined or len(self.ranks) == self.size

    def run(self, inject_s: float, end_s: float, stop_file: Optional[Path] = None) -> None:
        """Inject the failures (a rank 0 among the first few) for up to ``inject_s`` s, then wait for the job to
        end, up to ``end_s`` s from the start (then it is stopped: the figures are those of what ran)."""
        started = time.monotonic()
        forced_rank0 = self.rng.randrange(max(1, min(3, self.failures)))
        while len(self.injected) < self.failures and self.proc.poll() is None and \
                time.monotonic() - started < inject_s:
            time.sleep(self.rng.uniform(*self.interval))
            with self.lock:
                if any(line.startswith("final ") for line in self.lines[-50:]):
                    break  # the training is over: a rank killed now would have nothing to recover
                # only a job all of whose ranks joined (a rank killed before MPI_Init leaves the others waiting
                # there: docs/elastic.md, "Many failures")
                candidates = dict(self.ranks) if self.all_joined else {}
            if not candidates:
                continue
            rank = 0 if len(self.injected) == forced_rank0 and 0 in candidates else self.rng.choice(sorted(candidates))
            pid = candidates[rank]
            kind = "stop" if self.rng.random() < self.stop_fraction else "kill"
            try:
                os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            except ProcessLookupError:
                continue
            with self.lock:
                self.ranks.pop(rank, None)
            self.injected.append({"t": time.time(), "rank": rank, "pid": pid, "kind": kind, "size": self.size})
        if stop_file is not None:  # the training ends at the next epoch's end once the job is whole again
            last = self.injected[-1]["t"] if self.injected else 0.0
            while self.proc.poll() is None and time.monotonic() - started < end_s and not any(
                    (m := STEP.match(line)) and float(m.group(3)) > last and int(m.group(2)) == 4
                    for line in self.lines[-200:]):
                time.sleep(0.2)
            stop_file.touch()
        try:
            self.proc.wait(timeout=max(1.0, end_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            self.stop()
            self.proc.wait()
        self.reader.join(timeout=30)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def analyse(lines: list[str], injected: list[dict[str, Any]], code: int, epochs: int, samples: int,
            wall_s: float, times: Optional[list[float]] = None) -> dict[str, Any]:
    """The figures of one run (see the module's docstring)."""
    out = "\n".join(lines)
    steps = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in map(STEP.match, lines) if m]
    finals = [m for m in map(FINAL.match, lines) if m]
    after = [[s for s in steps if s[2] > f["t"]] for f in injected]
    recovery = [a[0][2] - f["t"] if a else None for f, a in zip(injected, after)]
    regrowth = [next((s[2] - f["t"] for s in a if s[1] == 4), None) for f, a in zip(injected, after)]
    lost = [prev - (nxt - 1) for (prev, _, _), (nxt, _, _) in zip(steps, steps[1:]) if nxt <= prev]
    named = sum(1 for f in injected if re.search(rf"\(pid {f['pid']}\) (failed|was declared failed)", out))
    report_line = next((line for line in reversed(lines) if line.startswith("{\"final\"")), "")
    report = json.loads(report_line)["final"] if report_line else {"epochs": [], "accuracy": None}
    epochs_seen = report["epochs"]
    exact = 0 < len(epochs_seen) <= epochs and all(e["unique"] == samples and 0 <= e["samples"] - samples < 4
                                                   for e in epochs_seen)
    shas = {m.group(4) for m in finals}
    span = steps[-1][2] - steps[0][2] if len(steps) > 1 else 0.0
    return {"exit_code": code, "finished": "job finished on" in out, "failures": len(injected),
            "kills": sum(f["kind"] == "kill" for f in injected), "stops": sum(f["kind"] == "stop" for f in injected),
            "rank0_failures": sum(f["rank"] == 0 for f in injected), "named_by_driver": named,
            "survived": named if code == 0 and exact and len(shas) == 1 else 0,
            "recovery_s": _spread(recovery), "regrowth_s": _spread(regrowth),
            "steps_lost": {"total": sum(lost), "max": max(lost, default=0), "rollbacks": len(lost)},
            "final_step": steps[-1][0] if steps else 0, "steps_per_s": (steps[-1][0] / span) if span else None,
            "wall_s": wall_s, "restarts": out.count("elastic: starting ") - 1, "standby": out.count("ago takes over"),
            "epochs_exact": exact, "padded_samples": sum(e["samples"] - samples for e in epochs_seen),
            "epochs_trained": len(epochs_seen), "final_ranks": len(finals), "weights_identical": len(shas) == 1,
            "accuracy": report["accuracy"], "test_accuracy": report.get("test_accuracy"),
            "regrowth_phases_s": _regrowth_phases(lines, times or [], injected),
            "per_failure": [
                {**f, "recovery_s": r, "regrowth_s": g} for f, r, g in zip(injected, recovery, regrowth)]}


#: A regrowth's phases (medians from the kill), each the count-th line with its text after the phase before: generation
#: raised (slots listed, the standby waiting), old job ended (its ranks left), new job started (or standby took over)...
REGROWTH_PHASES = (("hosts_changed", "elastic: hosts changed", 1), ("old_job_ended", "left to resize", 1),
                   ("new_job_started", "elastic: starting ", 1), ("all_joined", " joined from host ", 4),
                   ("resumed", "resumed from commit", 1))


def _regrowth_phases(lines: list[str], times: list[float], injected: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, list[float]] = {name: [] for name, _, _ in REGROWTH_PHASES}
    for failure, nxt in zip(injected, [f["t"] for f in injected[1:]] + [float("inf")]):
        at = failure["t"]
        for name, text, count in REGROWTH_PHASES:
            hits = [t for t, line in zip(times, lines) if at <= t < nxt and text in line]
            if len(hits) < count:
                break
            at = hits[count - 1]
            found[name].append(at - failure["t"])
    return {name: statistics.median(values) if values else None for name, values in found.items()}


def _spread(values: list[Optional[float]]) -> dict[str, Optional[float]]:
    done: list[Any] = sorted(v for v in values if v is not None) or [None]  # (no value: each None)
    return {"median": statistics.median(done), "p90": done[min(len(done) - 1, int(0.9 * len(done)))], "max": done[-1]}


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hvdlite-soak-") as tmp:
        script = Path(tmp) / "discover.sh"
        script.write_text("#!/bin/sh\necho localhost:4\n")
        script.chmod(0o755)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        stop_file, py = Path(tmp) / "stop", args.ompi_python
        cmd = [py, "-m", "hvdlite.run", "-np", "4", "--min-np", str(args.min_np), "--max-np", "4",
               "--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "3", py, str(WORKER),
               "--soak", "--epochs", str(args.epochs), "--samples", str(args.samples), "--batch-size", "8",
               "--commit-every", str(args.commit_every), "--width", str(args.width), "--sleep", str(args.sleep),
               "--stop-file", str(stop_file), "--seed", str(args.train_seed), *RECIPE]
        chaos = Chaos(cmd, env, args)
        started = time.monotonic()
        try:
            chaos.run(args.inject_s, args.end_s, stop_file if args.until_failures else None)
        finally:
            chaos.stop()
        return analyse(chaos.lines, chaos.injected, chaos.proc.returncode, args.epochs, args.samples,
                       time.monotonic() - started, chaos.times)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ompi-python", required=True)
    parser.add_argument("--failures", type=int, default=100)
    parser.add_argument("--interval", type=float, nargs=2, default=[5.0, 15.0])
    parser.add_argument("--stop-fraction", type=float, default=0.2)
    parser.add_argument("--min-np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--commit-every", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inject-s", type=float, default=float("inf"), help="stop injecting failures after this")
    parser.add_argument("--end-s", type=float, default=float("inf"), help="stop the job after this (finished: false)")
    parser.add_argument("--until-failures", action="store_true", help="end the training once whole after the last")
    parser.add_argument("--log", default="", help="write the chaos run's output here")
    parser.add_argument("--references", type=int, default=0, help="then this many undisturbed runs (module doc)")
    args = parser.parse_args(argv)
    result = run_once(argparse.Namespace(**vars(args), train_seed=0))
    refs = [run_once(argparse.Namespace(**{**vars(args), "failures": 0, "until_failures": False, "log": "",
                                           "epochs": result["epochs_trained"], "train_seed": seed}))
            for seed in range(args.references)]
    for key in ("accuracy", "test_accuracy", "steps_per_s") if refs else ():
        values = result[f"reference_{key}"] = [r[key] for r in refs]
        low, high = min(values), max(values)
        if key != "steps_per_s":  # within noise: inside the references' range widened by itself each way
            result[f"{key}_within_noise"] = 2 * low - high <= result[key] <= 2 * high - low
    print(json.dumps({"kind": "soak", **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
