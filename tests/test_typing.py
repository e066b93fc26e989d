"""The type check of the public API, run in CI as a test: mypy, strict on hvdlite/core, and a program that
uses ``hvdlite``, ``hvdlite.torch`` and ``hvdlite.tensorflow`` names as a user would (every name must be
visible to the checker: exported explicitly, ``py.typed`` shipped)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The frameworks and other outside packages are not analysed (slow, and not ours): their names are Any.
CONFIG = ("[mypy]\n"
          "[mypy-torch.*,tensorflow.*,keras.*,tf_keras.*,mpi4py.*,sklearn.*,cloudpickle.*,yaml.*,scipy.*]\n"
          "follow_imports = skip\nignore_missing_imports = True\n")


def _mypy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    return subprocess.run([sys.executable, "-m", "mypy", f"--config-file={config}",
                           f"--cache-dir={tmp_path / 'cache'}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_core_is_strictly_typed(tmp_path: Path) -> None:
    result = _mypy(tmp_path, "--strict", "hvdlite/core")
    assert result.returncode == 0, f"mypy --strict hvdlite/core:\n{result.stdout}{result.stderr}"
    assert "Success: no issues found" in result.stdout


def test_public_names_are_visible_to_a_type_checker(tmp_path: Path) -> None:
    program = tmp_path / "user_program.py"
    program.write_text(textwrap.dedent("""
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
    """))
    result = _mypy(tmp_path, "--strict", "--allow-untyped-calls", str(program))
    lines = [line for line in result.stdout.splitlines() if "user_program.py" in line]
    # the one planted error proves the checker saw the program and the types of hvdlite's names
    assert len(lines) == 1 and 'Incompatible types in assignment (expression has type "int", variable has ' \
        'type "str")' in lines[0], result.stdout + result.stderr
