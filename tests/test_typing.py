"""The checks of what is written, run in CI as tests: mypy over the whole package with the repository's own
configuration (setup.cfg: strict, with the frontends' relaxations each given a reason there), the linter (ruff,
configured in pyproject.toml), and a program that uses ``hvdlite``, ``hvdlite.torch`` and
``hvdlite.tensorflow`` names as a user would (every name must be visible to the checker: exported explicitly,
``py.typed`` shipped)."""
from __future__ import annotations

import configparser
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


#: A program that uses hvdlite's names as a user would, with one planted error (the last line): mypy must see
#: the program and the types of hvdlite's names. Checked in the same mypy run as the package (one analysis).
USER_PROGRAM = textwrap.dedent("""
    # mypy: allow-untyped-calls
    import numpy as np
    import hvdlite as hvd
    import hvdlite.torch as hvd_torch
    import hvdlite.tensorflow as hvd_tf
    import hvdlite.tensorflow.keras as hvd_keras

    hvd.init(cycle_time_ms=1.0)
    rank: int = hvd.rank() + hvd_torch.local_rank() + hvd_tf.size() + hvd_keras.cross_rank()
    total: np.ndarray = hvd.allreduce(np.ones(3), op=hvd.Sum, name="x")
    handle: hvd.Handle = hvd.allreduce_async(np.ones(3))
    ops = (hvd_torch.Average, hvd_tf.Adasum, hvd_keras.ProcessSet, hvd_torch.HorovodInternalError,
           hvd_tf.nccl_built(), hvd_torch.mpi_ops.rank, hvd_torch.DistributedOptimizer,
           hvd_tf.DistributedGradientTape, hvd_keras.DistributedOptimizer, hvd.LaunchError)
    bad: str = hvd.size()
""")


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One mypy run with setup.cfg's configuration over the package and the user program."""
    where = tmp_path_factory.mktemp("mypy")
    program = where / "user_program.py"
    program.write_text(USER_PROGRAM)
    return subprocess.run([sys.executable, "-m", "mypy", f"--config-file={ROOT / 'setup.cfg'}",
                           f"--cache-dir={where / 'cache'}", "hvdlite", str(program)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_configuration_is_strict_where_the_issue_says() -> None:
    """Strict globally; only the frontends are relaxed, and every relaxation has a reason comment above it."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config.getboolean("mypy", "strict") and config.get("mypy", "files").strip() == "hvdlite"
    text = (ROOT / "setup.cfg").read_text().splitlines()
    frontends = ("hvdlite.torch", "hvdlite.tensorflow", "hvdlite.lightning")
    for section in config.sections():
        if not section.startswith("mypy-hvdlite"):
            continue
        assert all(module.startswith(frontends) for module in section[len("mypy-"):].split(",")), \
            f"[{section}] relaxes a module outside the frontends: the core and the launcher stay strict"
        at = text.index(f"[{section}]")
        assert text[at - 1].startswith("#"), f"[{section}] in setup.cfg has no reason comment above it"


def test_the_package_passes_mypy_with_the_repository_configuration(
        mypy_run: subprocess.CompletedProcess[str]) -> None:
    """Every flag comes from setup.cfg (strict; the frontends' relaxations); the package has no error."""
    package = [line for line in mypy_run.stdout.splitlines() if line.startswith("hvdlite")]
    assert not package, "mypy (setup.cfg's configuration):\n" + "\n".join(package) + mypy_run.stderr
    assert "Found 1 error in 1 file" in mypy_run.stdout, mypy_run.stdout + mypy_run.stderr  # the planted one


def test_the_linter_passes() -> None:
    """ruff, configured in pyproject.toml (rules, line length, the folders it covers: the package, benchmarks/,
    examples/ and tests/, tests/parallel/ and tests/workers/ included)."""
    def ruff(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    result = ruff("--output-format", "concise")
    assert "No module named ruff" not in result.stderr, \
        "ruff is not installed: install the test extras (pip install -e '.[test]')"
    assert result.returncode == 0, f"ruff check:\n{result.stdout}{result.stderr}"
    checked = {Path(line).resolve().relative_to(ROOT).as_posix() for line in ruff("--show-files").stdout.split()}
    for path in ("hvdlite/__init__.py", "benchmarks/registry.py", "examples/pytorch_digits_elastic.py",
                 "tests/conftest.py", "tests/test_typing.py", "tests/parallel/conftest.py", "tests/workers/report.py"):
        assert path in checked, f"ruff does not check {path}: pyproject.toml's include leaves it out"


def test_public_names_are_visible_to_a_type_checker(mypy_run: subprocess.CompletedProcess[str]) -> None:
    lines = [line for line in mypy_run.stdout.splitlines() if "user_program.py" in line]
    # the one planted error proves the checker saw the program and the types of hvdlite's names
    assert len(lines) == 1 and 'Incompatible types in assignment (expression has type "int", variable has ' \
        'type "str")' in lines[0], mypy_run.stdout + mypy_run.stderr
