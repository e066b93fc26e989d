"""The documented interface between the core and the launcher (``hvdlite.run``): what the launcher may use.

Every other core module is private to the core (``tests/test_layering.py`` checks this).

- ``Config``, ``environ()``, ``getenv(name)``: the settings and the HVDLITE_/HOROVOD_ environment they read.
- ``launcher_rank()``: this process's rank and the job's size as its launcher announced them.
- ``int_or_none(text)``: an integer environment value, or None when unset or not a number.
- ``library_family(text)``, ``launcher_mismatch(library, family, launcher)``: which MPI a library text
  names, and why (with the fix) its ranks cannot run under a launcher of another MPI.
- ``probe_mpi_library()``: the MPI library mpi4py loads (text, version), without initializing MPI.
- ``probe_ulfm()``: whether that library can recover from a lost rank in-process (ULFM), and why.
- ``logger``: the rank-prefixed ``hvdlite`` logger.
- the build flags (``mpi_built()``, ``nccl_built()``, ...) and ``LaunchError``.
- for the elastic driver: the variables it sets in the ranks (``DRIVER_VARIABLE``, ``JOB_VARIABLE``,
  ``RESTART_VARIABLE``, ``GENERATION_VARIABLE``, ``SECRET_VARIABLE``), ``signature()`` (how a rank signs its
  messages), ``remove_job()`` (delete a run's commits on this machine), ``job_dir()`` (a run's commit
  directory) and ``remover_command()`` (the command that deletes one host's commit, run on that host);
  ``fence_command()`` and ``kill_if_same()`` (end a lost rank's process that is still there, on its host).
"""
from __future__ import annotations

from typing import Optional

from .build_flags import ccl_built, cuda_built, ddl_built, gloo_built, mpi_built, nccl_built, rocm_built
from .config import Config, environ, getenv
from .elastic_wire import (DRIVER_VARIABLE, GENERATION_VARIABLE, JOB_VARIABLE, MIN_NP_VARIABLE, RESTART_VARIABLE,
                           SECRET_VARIABLE, job_dir, remove_job, remover_command, signature)
from .errors import LaunchError
from .fencing import fence_command, kill_if_same
from .launch_check import int_or_none, launcher_mismatch, launcher_rank, library_family
from .log import logger

__all__ = ["Config", "environ", "getenv", "launcher_rank", "int_or_none", "library_family", "launcher_mismatch",
           "probe_mpi_library", "probe_ulfm", "logger",
           "LaunchError", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "DRIVER_VARIABLE", "JOB_VARIABLE", "RESTART_VARIABLE", "GENERATION_VARIABLE",
           "SECRET_VARIABLE", "MIN_NP_VARIABLE", "signature", "remove_job", "job_dir", "remover_command",
           "fence_command", "kill_if_same"]


def probe_mpi_library() -> Optional[tuple[str, tuple[int, int]]]:
    """(MPI_Get_library_version's text, (major, minor)) of the library mpi4py loads, without initializing
    MPI; None without mpi4py."""
    from .engine import mpi  # the one module that loads mpi4py
    return mpi.probe_library()


def probe_ulfm() -> tuple[bool, str]:
    """Whether the MPI library mpi4py loads has ULFM that hvdlite uses for in-process elastic recovery (Open
    MPI 5), and why; without initializing MPI."""
    from .engine import mpi
    return mpi.ulfm_library()
