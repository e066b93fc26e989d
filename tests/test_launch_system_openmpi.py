"""hvdlite-run with the distribution's Open MPI (apt's openmpi-bin and libopenmpi-dev) and mpi4py built against it
in a virtualenv, beside pip's MPICH: the most common HPC set-up (a system MPI, a project venv).

Every rank runs the python the user named (not /usr/bin/python3), Ctrl-C/SIGTERM/kill -9 behave as under MPICH,
and a launcher of the other MPI is explained in both directions. Without the distribution's Open MPI these
tests skip, saying how to install it; .ci/run installs it and sets HVDT_SYSTEM_OPENMPI=required, under which
its absence fails them instead.

mpi4py is compiled against the system Open MPI once and its wheel cached (in $HVDT_SYSTEM_OPENMPI_CACHE, by
default ~/.cache/hvdlite-tests/system-openmpi), keyed by the mpi4py, Python and Open MPI versions: the first
run compiles for minutes, later ones install the wheel in seconds.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import final_accuracy, make_child_venv
from cluster.fixtures import (PYTHON, ROOT, WORKERS, assert_ctrl_c_stops_every_rank, assert_kill_9_takes_the_job,
                              assert_topology, base_env, run, topology)
from hvdlite.run.launchers import OPENMPI, identify

MPIRUN, MPICC = "/usr/bin/mpirun", "/usr/bin/mpicc"
TOPOLOGY = str(WORKERS / "launch_topology.py")
REQUIRED = "HVDT_SYSTEM_OPENMPI"
#: The first run compiles mpi4py inside the first test's set-up (minutes on a loaded machine); every launch
#: below has its own timeout, so a hang still fails fast.
pytestmark = pytest.mark.timeout(2400)
CACHE = "HVDT_SYSTEM_OPENMPI_CACHE"


def _missing(reason: str) -> None:
    message = (f"{reason}: the distribution's Open MPI is needed (apt-get install openmpi-bin libopenmpi-dev; "
               f".ci/run installs it)")
    if os.environ.get(REQUIRED) == "required":
        pytest.fail(f"{message}; {REQUIRED}=required (set by .ci/run) makes its absence a failure")
    pytest.skip(message)


@pytest.fixture(scope="session")
def system_openmpi() -> str:
    """The version of the distribution's Open MPI (its mpirun and mpicc in /usr/bin)."""
    if not (os.access(MPIRUN, os.X_OK) and os.access(MPICC, os.X_OK)):
        _missing(f"no {MPIRUN} and {MPICC}")
    launcher = identify(MPIRUN, base_env())
    if launcher is None or launcher.kind != OPENMPI:
        _missing(f"{MPIRUN} is not Open MPI's ({launcher.describe() if launcher else 'unknown'})")
    return launcher.version.split()[-1]


def _mpi4py_wheel(ompi_version: str) -> Path:
    """mpi4py (the version this Python has) compiled against the system Open MPI, built once and cached."""
    version = importlib.metadata.version("mpi4py")
    key = f"mpi4py-{version}-py{sys.version_info[0]}{sys.version_info[1]}-openmpi-{ompi_version}-1"
    cache = Path(os.environ.get(CACHE) or Path.home() / ".cache" / "hvdlite-tests" / "system-openmpi") / key
    wheels = sorted(cache.glob("mpi4py-*.whl"))
    if wheels:
        return wheels[0]
    cache.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=key + ".", dir=cache.parent))
    # Built by a bare venv's python: this one's venv may hold pip MPICH's mpi.h in its include/, which the
    # compiler would find before Open MPI's (a wheel that then fails on undefined MPICH symbols).
    # -O0 -g0: the one big generated C file compiles several times faster than with -O3 -g.
    with tempfile.TemporaryDirectory() as bare:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", bare], check=True, timeout=120)
        env = {**os.environ, "MPICC": MPICC, "CFLAGS": "-O0 -g0"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(Path(bare, "bin", "python")), "wheel",
                               "-q", "--no-deps", "--no-cache-dir", "--disable-pip-version-check", "--no-binary",
                               "mpi4py", f"mpi4py=={version}", "-w", str(build)],
                              capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        shutil.rmtree(build, ignore_errors=True)
        pytest.fail(f"cannot build mpi4py=={version} against {MPICC}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    try:
        build.rename(cache)  # atomic: a concurrent run either finds the whole wheel or builds its own
    except OSError:
        shutil.rmtree(build, ignore_errors=True)
    return sorted(cache.glob("mpi4py-*.whl"))[0]


@pytest.fixture(scope="session")
def sysompi(system_openmpi: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv (the bin/ directory) whose mpi4py loads the system Open MPI; it sees this Python's other
    packages (numpy, hvdlite) and pip's MPICH too, as a user's venv with the mpich extra would."""
    wheel = _mpi4py_wheel(system_openmpi)
    python = make_child_venv(tmp_path_factory.mktemp("sysompi") / "venv")
    # --ignore-installed: the venv sees this Python's mpi4py (a binary wheel) and would keep it
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", "--ignore-installed", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    library = subprocess.run([str(python), "-c", "import mpi4py.MPI as M; print(M.__file__); "
                              "print(M.Get_library_version())"],
                             capture_output=True, text=True, timeout=120, env=_env(python.parent))
    assert library.stdout.startswith(str(python.parent.parent)), library.stdout + library.stderr  # the venv's own
    assert f"Open MPI v{system_openmpi}" in library.stdout, library.stdout + library.stderr
    return python.parent


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """The user's shell in the venv: its bin/ first, then the system's (where apt's mpirun is)."""
    env = base_env(**extra)
    env["PATH"] = os.pathsep.join([str(bin_dir), "/usr/local/bin", "/usr/bin", "/bin"])
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


def test_every_rank_runs_the_python_the_user_named(sysompi: Path, system_openmpi: str, nproc: int) -> None:
    """`hvdlite-run -np N python3 train.py` in the venv: Open MPI's mpirun (found in /usr/bin), every rank on
    the venv's python3 (Open MPI started by its absolute path puts /usr/bin first on the ranks' PATH)."""
    proc = run([str(sysompi / "python3"), "-m", "hvdlite.run", "--verbose", "-np", str(nproc), "python3", TOPOLOGY],
               env=_env(sysompi), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"hvdlite-run: launcher: Open MPI mpi(run|exec) \(/usr/bin/mpi(run|exec)\): Open MPI "
                     rf"{re.escape(system_openmpi)}$", proc.stdout, re.M), proc.stdout  # --check-build's line too
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=1, per_host=nproc)
    assert [r["executable"] for r in ranks] == [str(sysompi / "python3")] * nproc, ranks


SHEBANG_SCRIPT = """#!/usr/bin/env python3
import os, subprocess, sys
import hvdlite as hvd
hvd.init()
child = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                       check=True).stdout.strip()
sys.stdout.write(f"RANK {hvd.rank()} {sys.executable} {child} {os.environ['PATH']}\\n")  # one write: ranks interleave
"""


def test_a_shebang_script_and_its_subprocesses_run_the_venvs_python(sysompi: Path, tmp_path: Path,
                                                                     nproc: int) -> None:
    """`hvdlite-run -np N ./train.py` (`#!/usr/bin/env python3`) from the venv: every rank's PATH is the user's
    shell's, so the script and a `python3` it starts in a subprocess are the venv's (Open MPI's mpirun, started
    by its absolute path, put /usr/bin first: `No module named 'hvdlite'`, or the system's python3)."""
    script = tmp_path / "train.py"
    script.write_text(SHEBANG_SCRIPT)
    script.chmod(0o755)
    env = _env(sysompi)
    proc = run([str(sysompi / "python3"), "-m", "hvdlite.run", "-np", str(nproc), "./train.py"], env=env,
               timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = sorted(line.split(" ", 4)[1:] for line in proc.stdout.splitlines() if line.startswith("RANK "))
    venv = str(sysompi / "python3")
    assert ranks == [[str(r), venv, venv, env["PATH"]] for r in range(nproc)], proc.stdout + proc.stderr


def doc_block(doc: Path, heading: str) -> str:
    """The first ```bash block under ``heading`` in ``doc``."""
    section = doc.read_text().split(f"\n{heading}\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_docs_commands_from_a_fresh_clone(system_openmpi: str, tmp_path: Path) -> None:
    """docs/system-mpi.md's commands, as written, in a fresh virtualenv (one that sees this Python's packages, so
    pip finds torch and scikit-learn installed): hvdlite without MPICH, mpi4py compiled against the system's Open
    MPI (pip's wheel cache keeps later runs short), then the example trained on 2 ranks under its mpirun."""
    block = doc_block(ROOT / "docs" / "system-mpi.md", "## From a fresh clone, with the distribution's Open MPI")
    assert "[torch,examples]" in block and "hvdlite-run -np 2 python examples/pytorch_digits.py" in block, block
    bin_dir = make_child_venv(tmp_path / "venv").parent
    env = _env(bin_dir)
    env.pop("PYTHONPATH", None)  # the user's shell: hvdlite is what the block installs
    env["CFLAGS"] = "-O0 -g0"  # (the test's only addition: mpi4py's one big C file compiles several times faster)
    proc = run(["bash", "-euo", "pipefail", "-c", block], env=env, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert final_accuracy(proc.stdout, proc.stderr) > 0.9, proc.stdout[-3000:]


def test_signals_and_kill_9_under_open_mpi(sysompi: Path, tmp_path: Path) -> None:
    """The same exit codes as under MPICH (Open MPI's mpirun itself says 1): Ctrl-C 130, SIGTERM 143, and kill -9
    of hvdlite-run leaves no mpirun, sentinel or rank behind."""
    cmd = [str(sysompi / "python3"), "-m", "hvdlite.run", "-np", "2"]
    python = str(sysompi / "python3")
    for name, sig in (("int", signal.SIGINT), ("term", signal.SIGTERM), ("kill", signal.SIGKILL)):
        (tmp_path / name).mkdir()
        if sig == signal.SIGKILL:
            assert_kill_9_takes_the_job(cmd, _env(sysompi), tmp_path / name, python=python)
            continue
        out = assert_ctrl_c_stops_every_rank(cmd, _env(sysompi), tmp_path / name, sig=sig, python=python)
        assert "Traceback" not in out and "was killed by signal" not in out, out


def test_a_launcher_of_the_other_mpi_is_explained(sysompi: Path) -> None:
    """Open MPI's mpirun with pip MPICH's mpi4py (MPICH would die in its own MPI_Init), and MPICH's mpiexec with
    Open MPI's mpi4py (each rank would be a job of size 1): each rank says which MPI is which and the fix;
    hvdlite-run refuses the first before starting anything."""
    program = "import hvdlite as hvd; hvd.init(); print('started', hvd.size())"
    proc = run([MPIRUN, "--allow-run-as-root", "-np", "2", PYTHON, "-c", program], timeout=120,
               env=base_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    assert proc.returncode != 0 and "started" not in proc.stdout, proc.stdout + proc.stderr
    errors = re.findall(r"LaunchError: (rank \d of 2): mpi4py loads MPICH.* but the ranks are started by Open MPI's "
                        r"mpirun/mpiexec .*Fix: launch with MPICH's mpiexec .* rebuild mpi4py against Open MPI: "
                        r"MPICC=", proc.stderr)
    assert sorted(errors) == ["rank 0 of 2", "rank 1 of 2"], proc.stderr
    # (MPICH's own crash, explaining nothing)
    assert "Fatal error in internal_Init_thread" not in proc.stderr, proc.stderr

    mpiexec = str(Path(PYTHON).parent / "mpiexec")  # pip's MPICH (hydra)
    proc = run([mpiexec, "-n", "2", str(sysompi / "python3"), "-c", program], env=_env(sysompi), timeout=120)
    assert proc.returncode != 0 and "started" not in proc.stdout, proc.stdout + proc.stderr
    errors = re.findall(r"LaunchError: (rank \d of 2): the launcher started 2 ranks \(PMI_SIZE=2\) .* mpi4py loads "
                        r"Open MPI .*Open MPI cannot join a job that MPICH's hydra mpiexec started", proc.stderr)
    assert sorted(errors) == ["rank 0 of 2", "rank 1 of 2"], proc.stderr

    env = base_env()
    env["PATH"] = os.pathsep.join([env["PATH"], "/usr/bin"])
    proc = run([PYTHON, "-m", "hvdlite.run", "--launcher", "openmpi", "-np", "2", PYTHON, "-c", program], env=env,
               timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert re.fullmatch(r"hvdlite-run: error: mpi4py loads MPICH.* but the ranks are started by Open MPI mpi\w+ "
                        r"\(/usr/bin/mpi\w+\): Open MPI [\d.]+; MPICH cannot join .*\n", proc.stderr), proc.stderr
