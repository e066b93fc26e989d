"""hvdlite-run: start one hvdlite process per slot with mpiexec, mpirun or srun (``python -m hvdlite.run``)."""
from __future__ import annotations

from .launchers import Launcher, LauncherError

__all__ = ["Launcher", "LauncherError", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hvdlite-run``; returns the job's exit code."""
    from .__main__ import main as _main
    return _main(argv)
