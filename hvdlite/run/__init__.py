"""hvdlite-run: start one hvdlite process per slot with mpiexec, mpirun or srun (``python -m hvdlite.run``)."""
from __future__ import annotations

import sys
import types
from typing import Any

from .func import RankError, run
from .launchers import LaunchError, Launcher

__all__ = ["LaunchError", "Launcher", "RankError", "main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hvdlite-run``; returns the job's exit code."""
    from .__main__ import main as _main
    return _main(argv)


class _CallableModule(types.ModuleType):
    """The package is callable, as ``horovod.run``: ``hvdlite.run(fn, ...)`` is ``hvdlite.run.run(fn, ...)``."""

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return run(func, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
