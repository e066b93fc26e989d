"""Shared test helpers: launching real MPI jobs of the project's worker scripts, with timeouts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def mpiexec_path() -> str:
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        pytest.fail("no mpiexec on PATH: install the test extras (pip install -e '.[all]'), which bring the "
                    "pip 'mpich' runtime")
    return found


def run_mpi(script: str | Path, n: int, args: Sequence[str] = (), timeout: float = 120,
            env: Optional[Mapping[str, str]] = None, check: bool = True,
            mpi_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``python script args`` under ``mpiexec -n n``; fail the test on a non-zero exit or timeout.

    ``script`` is a path, or a file name under tests/workers/.
    """
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = WORKERS / path
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    cmd = [mpiexec_path(), "-n", str(n), *mpi_args, sys.executable, str(path), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s (deadlock?)\nstdout:\n{out}\nstderr:\n{err}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture(params=[2, 3], ids=["np2", "np3"])
def nproc(request: pytest.FixtureRequest) -> int:
    """Run a multi-process test at 2 and at 3 ranks (odd sizes catch bugs)."""
    return request.param
